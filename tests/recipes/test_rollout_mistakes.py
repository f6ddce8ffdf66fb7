"""A newcomer's rollout mistakes (issue #31), each answered by one clear message naming the field and the row.

Every test runs the real recipe on the tiny model against the real server; the mistakes are the user's code.
"""

import re
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.recipes.test_fault_matrix import sampling_rollout, server  # noqa: F401 - the module's server fixture
from tests.recipes.test_recipes import ROWS
from tests.recipes.test_recipes import config as recipes_config
from training.recipes import async_rl_loop, rl_loop
from training.recipes.context import RolloutFailureError
from training.utils.metrics import read_metrics
from training.utils.rl.rollout import RolloutSample


def config(tiny_model_path, server, tmp_path, **kw):  # noqa: F811
    return recipes_config(tiny_model_path, server, tmp_path, **{"max_steps": 1, **kw})


def warnings_with(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def test_a_key_error_prints_its_traceback_once_naming_the_data_row(tiny_model_path, server, tmp_path, caplog):  # noqa: F811
    """Before: 48 one-line warnings "rollout of row 0 raised KeyError", no traceback, and "row 0" was a shuffled
    position. Now: one warning with the traceback and the row's index in the user's rows (and its id); the
    later failures are counted (``rollout/failures_unprinted``), and rollouts.jsonl names each trained row."""
    bad = []

    def factory(setup):
        good = sampling_rollout(setup)

        async def rollout_fn(row):
            if not bad or row["id"] == bad[0]:
                bad.append(row["id"])
                return row["question"]  # the mistake: the rows have no "question"
            return await good(row)

        return rollout_fn

    cfg = config(
        tiny_model_path, server, tmp_path, shuffle_rows=True, completions_per_prompt=3, max_rollout_error_fraction=0.9
    )
    out = async_rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    assert out["steps"] == 1
    (record,) = warnings_with(caplog, "raised KeyError")
    row = bad[0]
    assert f"rollout of data row {row} (id {row}) raised KeyError: 'question'" in record.getMessage()
    assert record.exc_info is not None and "rollout_fn" in caplog.text and 'row["question"]' in caplog.text
    m = read_metrics(cfg.log_path)
    assert sum(r.get("rollout/errors", 0) for r in m) == 3
    assert sum(r.get("rollout/failures_unprinted", 0) for r in m) == 2
    lines = [json.loads(x) for x in (Path(cfg.log_path) / "rollouts.jsonl").read_text().splitlines()]
    assert lines and all(x["row_index"] == x["row_id"] == ROWS[x["row_index"]]["id"] for x in lines)
    assert any(x["row_index"] != x["row_position"] for x in lines)  # shuffled: the position is not the row


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_numpy_and_torch_rewards_train(tiny_model_path, server, tmp_path, kind):  # noqa: F811
    """Before: a numpy or torch scalar reward was refused as "not a finite number"."""
    make = {"numpy": np.float32, "torch": torch.tensor}[kind]

    def factory(setup):
        good = sampling_rollout(setup)

        async def rollout_fn(row):
            sample = await good(row)
            sample.reward = make(sample.reward)
            return sample

        return rollout_fn

    cfg = config(tiny_model_path, server, tmp_path)
    assert rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)["steps"] == 1
    lines = [json.loads(x) for x in (Path(cfg.log_path) / "rollouts.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(isinstance(x["reward"], float) for x in lines)


@pytest.mark.parametrize(
    "mistake, says",
    [
        ("reward None", "reward: None (NoneType) is not a number"),
        ("a dict", "rollout result: expected RolloutSample, RolloutRun or None, got dict"),
    ],
)
def test_a_result_without_a_reward_is_one_clear_error_in_training_and_eval(
    tiny_model_path,
    server,  # noqa: F811
    tmp_path,
    caplog,
    mistake,
    says,
):
    """Before: reward=None crashed with a raw TypeError and 34 disconnect warnings; a dict scored eval 0.000
    silently. Now each says once, in eval and in training, which field is wrong and for which row; the run
    stops on the error budget with RolloutFailureError."""

    def factory(setup):
        good = sampling_rollout(setup)

        async def rollout_fn(row):
            sample: RolloutSample = await good(row)
            if mistake == "a dict":
                return {"tokens": sample.tokens, "reward": sample.reward}
            sample.reward = None
            return sample

        return rollout_fn

    cfg = config(tiny_model_path, server, tmp_path, eval_rows=ROWS[:3], eval_interval=1)
    with pytest.raises(RolloutFailureError, match="invalid"):
        rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    (eval_line,) = warnings_with(caplog, "eval rollout of data row")
    (train_line,) = warnings_with(caplog, "rollout of data row")[1:] or [None]
    assert says in eval_line.getMessage() and says in train_line.getMessage()
    assert re.search(r"data row ([012]) \(id \1\)", eval_line.getMessage()), (
        "one of the three eval rows, which runs first"
    )
    assert warnings_with(caplog, "eval: 3 of 3 rollouts failed")
    (m,) = read_metrics(cfg.log_path)  # the step-0 eval
    assert m["eval/failed"] == 3.0
    assert not warnings_with(caplog, "TypeError")


def test_a_plain_def_rollout_fn_is_refused_at_start_with_one_line(tiny_model_path, server, tmp_path, caplog):  # noqa: F811
    """Before: `def` instead of `async def` printed an asyncio message once per rollout."""

    def factory(setup):
        def rollout_fn(row):
            return None

        return rollout_fn

    cfg = config(tiny_model_path, server, tmp_path)
    with pytest.raises(TypeError) as e:
        rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    assert str(e.value) == (
        "rollout_fn: rollout_fn is a plain `def`; declare it `async def rollout_fn(row)` (the recipe awaits it)"
    )
    assert not Path(cfg.log_path, "metrics.jsonl").exists()
