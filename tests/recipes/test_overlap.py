"""Whether a run samples while it trains is decided once, by ``Config.rollouts_overlap_training`` (from
``trains_synchronously``), and no setting the user gave is rewritten: a conflicting pair is an error."""

from __future__ import annotations

import dataclasses

import pytest

from training.recipes import async_rl_loop, rl_loop
from training.recipes.config import Config
from training.utils import DeployConfig
from training.utils.config import ConfigError


@pytest.mark.parametrize(
    "synchronous, colocate, offpolicy, drains, overlaps",
    [
        (None, False, 0, False, False),  # the gate admits nothing until the push
        (None, False, 1, False, True),
        (False, False, 2, False, True),
        (True, False, 1, True, False),
        (True, True, 1, True, False),
        (None, True, 1, True, False),  # colocated: the engine sleeps while the trainer trains
    ],
)
def test_overlap_follows_the_documented_table(synchronous, colocate, offpolicy, drains, overlaps):
    cfg = Config(
        base_model="m",
        synchronous_training=synchronous,
        max_head_offpolicy_versions=offpolicy,
        deployment=DeployConfig(colocate=colocate),
    )
    assert (cfg.trains_synchronously, cfg.rollouts_overlap_training) == (drains, overlaps)
    assert async_rl_loop.AsyncRLLoop.overlaps(cfg) is overlaps  # the loops ask the config, not their own rule
    assert rl_loop.SyncRLLoop.overlaps(cfg) is False


def test_colocate_with_explicit_overlap_is_an_error_naming_both_fields():
    with pytest.raises(ConfigError, match=r"^synchronous_training: .*synchronous_training=False.*deployment\.colocate"):
        Config(base_model="m", synchronous_training=False, deployment=DeployConfig(colocate=True))


def test_a_colocated_run_keeps_the_users_synchronous_training_as_given():
    cfg = Config(base_model="m", max_head_offpolicy_versions=1, deployment=DeployConfig(colocate=True))
    assert cfg.synchronous_training is None and cfg.trains_synchronously
    again = dataclasses.replace(cfg, deployment=DeployConfig())  # validated again from the user's values
    assert again.synchronous_training is None and again.rollouts_overlap_training
    assert cfg.to_dict()["synchronous_training"] is None  # the run record holds the setting as given


def test_a_key_value_override_into_the_conflict_is_refused():
    from training.utils.cli import apply_overrides

    cfg = Config(base_model="m", deployment=DeployConfig(colocate=True))
    assert apply_overrides(cfg, ["synchronous_training=true"]).trains_synchronously
    with pytest.raises((ConfigError, SystemExit), match="deployment.colocate"):
        apply_overrides(cfg, ["synchronous_training=false"])


def test_synchronous_training_refuses_a_non_boolean():
    with pytest.raises(ConfigError, match="^synchronous_training:"):
        Config(base_model="m", synchronous_training="yes")
