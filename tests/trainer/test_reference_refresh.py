"""The reference refresh (``LossConfig.reference_refresh_interval``): after a refreshing step the reference scores like
the updated policy, the steps in between leave it alone, and a checkpoint carries the refreshed reference."""

import pytest
import torch

from training.trainer import PolicyTrainer, ReferenceModel
from training.utils.checkpoint import load_checkpoint, save_checkpoint
from training.utils.config import TrainerConfig
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.ppo import StepBatch, refreshes_reference, train_on_batch

PROMPT = [5, 17, 42, 99, 7]
COMPLETIONS = [[11, 23, 5, 8], [40, 2, 9, 31, 77, 6]]
BATCH = StepBatch(
    tokens=[PROMPT + c for c in COMPLETIONS],
    sampler_logprobs=[[0.0] * (len(PROMPT) + len(c)) for c in COMPLETIONS],
    loss_masks=[[0] * len(PROMPT) + [1] * len(c) for c in COMPLETIONS],
    advantages=[1.0, -1.0],
    weights=[1.0, 1.0],
)


def test_a_refreshing_step_leaves_the_reference_equal_to_the_updated_policy(tiny_model_path, tmp_path):
    cfg = TrainerConfig(device="cpu", learning_rate=5e-2)
    trainer, reference = PolicyTrainer(tiny_model_path, cfg), ReferenceModel(tiny_model_path, cfg)
    start = reference.logprobs(BATCH.tokens)
    loss = LossConfig(kl_beta=0.1, reference_refresh_interval=2)
    assert [refreshes_reference(loss, s) for s in (1, 2, 3, 4)] == [False, True, False, True]
    m = train_on_batch(trainer, BATCH, loss, reference=reference, refresh_reference=refreshes_reference(loss, 1))
    assert "train/reference_refreshed" not in m and reference.logprobs(BATCH.tokens) == start
    m = train_on_batch(trainer, BATCH, loss, reference=reference, refresh_reference=refreshes_reference(loss, 2))
    assert m["train/reference_refreshed"] == 1.0
    now = trainer.logprobs(BATCH.tokens)
    assert reference.logprobs(BATCH.tokens) == now and now != start

    folder = save_checkpoint(tmp_path, 2, trainer.model, trainer.optimizer, {"step": 2}, reference=reference)
    fresh_trainer, fresh_reference = PolicyTrainer(tiny_model_path, cfg), ReferenceModel(tiny_model_path, cfg)
    load_checkpoint(folder, fresh_trainer.model, fresh_trainer.optimizer, reference=fresh_reference)
    for (name, a), (_, b) in zip(fresh_reference.model.named_parameters(), reference.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_refresh_needs_a_reference_and_no_lora():
    from training.recipes.config import Config
    from training.utils.config import ConfigError

    with pytest.raises(ValueError, match="^reference_refresh_interval: needs kl_beta > 0"):
        LossConfig(kl_beta=0.0, reference_refresh_interval=5)
    with pytest.raises(ValueError, match="^reference_refresh_interval: must be an int >= 0"):
        LossConfig(reference_refresh_interval=-1)
    with pytest.raises(ConfigError, match="^loss.reference_refresh_interval: with LoRA"):
        Config(base_model="m", trainer=TrainerConfig(lora_rank=4), loss=LossConfig(reference_refresh_interval=5))
    assert "reference_refresh_interval" not in Config(base_model="m").to_dict()["loss"]
