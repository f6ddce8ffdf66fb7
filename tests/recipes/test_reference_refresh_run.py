"""A run with ``loss.reference_refresh_interval``: the refresh happens on its steps, the refreshed reference goes into
the checkpoint, and a resumed run loads it (the KL it logs continues from the refreshed reference, not the start)."""

import pytest

from training.recipes import rl_loop
from training.utils import DeployConfig, LossConfig, TrainerConfig
from training.utils.metrics import read_metrics

ROWS = [{"id": i, "prompt_ids": [1, 10 + i, 20 + i % 7, 201]} for i in range(12)]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(fresh=True, max_batch_size=16)  # the runs push their weights to it


def test_refreshes_are_logged_checkpointed_and_resumed(tiny_model_path, server, tmp_path):
    def run(max_steps):
        cfg = rl_loop.Config(
            base_model=tiny_model_path,
            log_path=str(tmp_path / "run"),
            completions_per_prompt=2,
            prompt_groups_per_step=2,
            max_tokens=6,
            max_steps=max_steps,
            dcp_save_interval=1,
            export_final_model=False,
            trainer=TrainerConfig(learning_rate=5e-2),
            loss=LossConfig(kl_beta=0.1, reference_refresh_interval=2),
            deployment=DeployConfig(base_url=server.base_url),
        )
        return rl_loop.main(cfg, rows=ROWS)

    run(2)
    first = read_metrics(tmp_path / "run")
    assert [r.get("train/reference_refreshed", 0.0) for r in first] == [0.0, 1.0]
    assert first[0]["train/kl_ref_k3"] == 0.0  # the policy starts as the reference
    run(3)  # resumes from step 2, whose checkpoint holds the refreshed reference
    rows = read_metrics(tmp_path / "run")
    resumed = [r for r in rows if r["step"] == 2][-1]
    # the step after a refresh starts at the reference: its pre-update KL is 0 again, which it would not be
    # had the resumed run rebuilt the reference from the base model
    assert resumed["train/kl_ref_k3"] == pytest.approx(0.0, abs=1e-7)
