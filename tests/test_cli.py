"""``key=value`` overrides are converted by the field's annotation, with one message per bad value."""

from typing import Optional

import pytest

from training.recipes.async_rl_loop import Config
from training.utils import DeployConfig, TrainerConfig
from training.utils.cli import OverrideError, apply_overrides, help_text, parse_value

pytestmark = pytest.mark.unit  # no model, no server: part of the sub-minute loop


def cfg() -> Config:
    return Config(base_model="m")


def test_values_take_the_type_of_their_field():
    c = apply_overrides(
        cfg(),
        [
            "log_path=2024",
            "max_steps=7",
            "trainer.learning_rate=3e-4",
            "shuffle_rows=false",
            "trainer.adam_betas=[0.9, 0.99]",
            "eval_rows=null",
            "temperature=1",
            "deployment.engine_config.max_model_len=512",
            "deployment.engine_config.cuda_graph_batch_sizes=[4, 1]",
            'deployment.engine_env={"A": "1"}',
            'sampling_kwargs={"top_p": 0.9}',
        ],
    )
    assert c.log_path == "2024" and isinstance(c.log_path, str)
    assert c.max_steps == 7 and c.trainer.learning_rate == 3e-4 and c.shuffle_rows is False
    assert c.trainer.adam_betas == (0.9, 0.99) and c.eval_rows is None
    assert c.temperature == 1.0 and isinstance(c.temperature, float)
    assert c.deployment.engine_config.max_model_len == 512
    assert c.deployment.engine_config.cuda_graph_batch_sizes == (1, 4)
    assert c.deployment.engine_env == {"A": "1"} and c.sampling_kwargs == {"top_p": 0.9}


def test_union_fields_pick_the_structured_option_first():
    one = apply_overrides(cfg(), ["deployment.base_url=http://h:1"]).deployment.base_url
    many = apply_overrides(cfg(), ['deployment.base_url=["http://h:1", "http://h:2"]']).deployment.base_url
    assert one == "http://h:1" and many == ["http://h:1", "http://h:2"]


@pytest.mark.parametrize(
    "arg, message",
    [
        ("max_steps=5.5", "bad override 'max_steps=5.5': max_steps: expected an integer, got '5.5'"),
        ("shuffle_rows=maybe", "shuffle_rows: expected true or false, got 'maybe'"),
        ("trainer.adam_betas=[0.9]", "trainer.adam_betas: expected 2 values, got 1"),
        ("trainer.learning_rate=-1", "trainer.learning_rate: must be > 0, got -1.0"),
        ("max_steps=0", "max_steps: must be >= 1 or None"),
        ("trainer.nope=1", "unknown config field 'trainer.nope'"),
        ("trainer=1", "trainer: is a sub-config"),
        ("dynamic_filter_fn=x", "dynamic_filter_fn: "),
    ],
)
def test_a_bad_value_stops_with_one_message_naming_the_key(arg, message):
    with pytest.raises(SystemExit) as e:
        apply_overrides(cfg(), [arg])
    text = str(e.value)
    assert message in text, text
    key = arg.split("=")[0]
    assert text.count(f"{key}:") <= 1  # the key is named once, not prefixed twice


def test_parse_value_refuses_what_the_annotation_refuses():
    with pytest.raises(OverrideError, match="expected a number"):
        parse_value("fast", float, "x")
    assert parse_value("null", Optional[int], "x") is None and parse_value("3", Optional[int], "x") == 3


def test_help_shows_nested_fields_with_their_docs():
    text = help_text(Config(base_model="m", deployment=DeployConfig(), trainer=TrainerConfig()))
    assert "deployment.engine_config.max_batch_size=64" in text and "KV cache slots" in text
    assert "trainer.learning_rate=1e-05" in text
