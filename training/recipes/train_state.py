"""A run's ``TrainState``: the parts every rank builds (the data cursor, the policy trainer, the reference
model) and where the run resumes. ``build_train_state`` loads them and resumes from the newest
checkpoint in ``log_path``; under ``torchrun`` every rank calls it and gets the same state (the model
sharded with FSDP2).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.recipes.config import Config
from training.utils.checkpoint import load_latest_checkpoint, set_rng_state
from training.utils.rl.advantages import ADVANTAGE_ESTIMATORS
from training.utils.data import RowCursor
from training.utils.rl.losses import needs_reference_logprobs

logger = logging.getLogger("training.recipe")


@dataclass
class TrainState:
    """The parts every rank builds: the data cursor, the policy trainer, the reference model, where
    the run resumes."""

    cursor: RowCursor
    trainer: Any
    """``PolicyTrainer``."""
    reference: Any
    """``ReferenceModel`` (with LoRA: the policy's base weights, adapters off) when the loss needs reference
    logprobs, else None."""
    start_step: int
    """0 for a fresh run; the step after the newest checkpoint for a resumed one."""

    @property
    def tokenizer(self) -> Any:
        return self.trainer.tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.trainer.model.get_input_embeddings().weight.shape[0])


def build_train_state(cfg: Config, model_path: str, num_rows: int, log_path: Path) -> TrainState:
    """Load the policy (and the frozen reference when the loss needs it), resume from the newest checkpoint that
    loads (``load_latest_checkpoint``: a damaged newer one is skipped with a warning)."""
    from training.trainer import PolicyTrainer, ReferenceModel

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    cursor = RowCursor(num_rows, cfg.epochs, cfg.seed, cfg.shuffle_rows)
    trainer = PolicyTrainer(model_path, cfg.trainer, total_steps=cfg.optimizer_steps)
    reference = None
    if needs_reference_logprobs(cfg.loss):  # with LoRA: the policy's own base weights, adapters off
        reference = trainer.base_reference() if trainer.lora else ReferenceModel(model_path, cfg.trainer)
    if ADVANTAGE_ESTIMATORS[cfg.advantage_estimator].critic:  # advantage="gae": a value head beside the policy
        trainer.attach_critic(cfg.critic)
    start_step = 0
    resumed = load_latest_checkpoint(  # the newest that loads
        log_path / "checkpoints",
        trainer.model,
        trainer.optimizer,
        critic=trainer.critic,
        reference=reference if cfg.loss.reference_refresh_interval else None,  # a refreshed one is in the checkpoint
    )
    if resumed is not None:
        ckpt, state = resumed
        start_step = int(state["step"])
        cursor.load_state(state["cursor"])
        set_rng_state(state["rng"])
        logger.info("resumed from %s at step %d", ckpt, start_step)
    return TrainState(cursor, trainer, reference, start_step)
