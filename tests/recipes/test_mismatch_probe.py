"""The mismatch monitor end to end (training/utils/rl/mismatch_probe.py): the real embedded server samples in fp32,
the trainer scores in bf16 autocast (a real engine-trainer gap, no fake), and the probes find that fp32 removes it.
With the defaults (both fp32) the gap stays under 1e-4 and no probe runs."""

import logging

import pytest

from training.recipes import rl_loop
from training.utils import DeployConfig, LossConfig, TrainerConfig
from training.utils.metrics import read_metrics
from training.utils.rl.mismatch_probe import masked_gap

ROWS = [{"id": i, "prompt_ids": [1, 10 + i, 20 + i % 7, 201]} for i in range(8)]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(fresh=True, max_batch_size=16)  # the runs push their weights to it


def run(tiny_model_path, server, tmp_path, name, **kw):
    cfg = rl_loop.Config(
        base_model=tiny_model_path,
        log_path=str(tmp_path / name),
        completions_per_prompt=2,
        prompt_groups_per_step=2,
        max_tokens=6,
        max_steps=3,
        export_final_model=False,
        loss=LossConfig(kl_beta=0.0),
        deployment=DeployConfig(base_url=server.base_url),
        **kw,
    )
    rl_loop.main(cfg, rows=ROWS)
    return read_metrics(cfg.log_path)


def test_a_bf16_trainer_against_an_fp32_engine_is_probed_once_and_fp32_named_as_the_cause(
    tiny_model_path, server, tmp_path, caplog
):
    trainer = TrainerConfig(learning_rate=1e-3, compute_dtype="bfloat16", micro_batch_tokens=64)
    with caplog.at_level(logging.WARNING, logger="training.recipe"):
        rows = run(tiny_model_path, server, tmp_path, "bf16", trainer=trainer, mismatch_probe_threshold=1e-4)
    assert rows[0]["train/logprob_diff_mean"] > 1e-4  # the gap that arms the probes, at step 0
    probed = [r for r in rows if "mismatch/trainer_mean" in r]
    assert [r["step"] for r in probed] == [1], "once, at the step after the one that passed the threshold"
    m = probed[0]
    assert m["mismatch/trainer_fp32_mean"] < 0.25 * m["mismatch/trainer_mean"]
    assert m["mismatch/trainer_one_by_one_mean"] > 0.25 * m["mismatch/trainer_mean"]
    assert m["mismatch/engine_prefill_mean"] < 1e-4  # the engine agrees with itself
    assert m["mismatch/engine_prefill_vs_trainer_mean"] > 0.25 * m["mismatch/trainer_mean"]
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("logprob mismatch")]
    assert "at step 1" in line and "cause: the trainer's bf16 compute" in line and "packing" not in line


def test_with_the_defaults_the_embedded_engine_and_the_trainer_agree_under_1e_4(tiny_model_path, server, tmp_path):
    rows = run(tiny_model_path, server, tmp_path, "fp32", trainer=TrainerConfig(learning_rate=1e-3))
    assert all(r["train/logprob_diff_max"] < 1e-4 for r in rows)
    assert not any("mismatch/trainer_mean" in r for r in rows)


def test_the_gap_counts_the_trained_tokens_and_skips_unscored_positions():
    mean, worst = masked_gap([[0.0, -1.0, -2.0, -3.0]], [[None, -1.5, -2.0, -9.0]], [[0, 1, 1, 0]])
    assert (mean, worst) == (0.25, 0.5)
    assert masked_gap([[0.0]], [[None]], [[1]]) == (0.0, 0.0)
