"""Each registered policy loss, driven through PolicyTrainer end to end, raises the logprob of
the positive-advantage sequence on a fixed batch."""

import math
import random
from pathlib import Path

import pytest

from training.trainer import PolicyTrainer, ReferenceModel
from training.utils.config import TrainerConfig
from training.utils.rl.losses import LOSSES, compute_policy_loss, needs_reference_logprobs
from training.utils.rl.losses.common import LossInputs
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.losses.registry import NOT_LOSSES

PROMPT_LEN, COMPLETION_LEN = 6, 10
ADVANTAGES = [1.5, -0.5, -0.5, -0.5]  # sequence 0 is the preferred one
STEPS, UPDATES_PER_STEP = 2, 2  # two updates per step: the second sees r != 1, so clipping can act


def _batch(seed=0, vocab=400):
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(PROMPT_LEN)]
    sequences = [prompt + [rng.randrange(vocab) for _ in range(COMPLETION_LEN)] for _ in ADVANTAGES]
    masks = [[0] * PROMPT_LEN + [1] * COMPLETION_LEN for _ in ADVANTAGES]
    return sequences, masks


def _masked_mean(values, mask):
    return sum(v * m for v, m in zip(values, mask)) / sum(mask)


def _loss_fn(cfg, old, sampler, ref, masks, total_tokens, total_sequences):
    def loss_fn(packed, logprobs_N):
        inputs = LossInputs(
            logprobs_N=logprobs_N,
            old_logprobs_N=packed.gather(old),
            sampler_logprobs_N=packed.gather(sampler),
            advantages_N=packed.gather(ADVANTAGES),
            loss_mask_N=packed.gather(masks),
            sequence_index_N=packed.sequence_index_N,
            num_sequences=packed.num_sequences,
            ref_logprobs_N=packed.gather(ref) if ref is not None else None,
        )
        return compute_policy_loss(inputs, cfg, total_tokens, total_sequences)

    return loss_fn


@pytest.fixture(scope="module")
def reference_logprobs(tiny_model_path):
    sequences, _ = _batch()
    return ReferenceModel(tiny_model_path, TrainerConfig(device="cpu")).logprobs(sequences)


def test_every_loss_module_is_covered():
    """The losses below come from the registry; every loss file of the folder is in it."""
    folder = Path(__file__).resolve().parents[2] / "training" / "utils" / "rl" / "losses"
    modules = {p.stem for p in folder.glob("*.py")} - NOT_LOSSES
    assert sorted(LOSSES) == sorted(modules) and len(modules) >= 7


@pytest.mark.parametrize("policy_loss", sorted(LOSSES))
def test_loss_raises_preferred_sequence_logprob(tiny_model_path, reference_logprobs, policy_loss):
    # 40-token micro-batches: the 4 × 16-token batch runs as 2 micro-batches (step-wide denominators matter)
    trainer = PolicyTrainer(
        tiny_model_path, TrainerConfig(device="cpu", learning_rate=5e-3, micro_batch_tokens=40, logprob_chunk_tokens=8)
    )
    cfg = LossConfig(policy_loss=policy_loss, kl_beta=0.001)
    sequences, masks = _batch()
    total_tokens = sum(map(sum, masks))
    sampler = [[lp * m for lp, m in zip(lps, mask)] for lps, mask in zip(trainer.logprobs(sequences), masks)]
    ref = reference_logprobs if needs_reference_logprobs(cfg) else None
    before = _masked_mean(trainer.logprobs(sequences)[0], masks[0])
    for _ in range(STEPS):
        old = trainer.logprobs(sequences)
        loss_fn = _loss_fn(cfg, old, sampler, ref, masks, total_tokens, len(sequences))
        for _ in range(UPDATES_PER_STEP):
            metrics = trainer.forward_backward(sequences, loss_fn)
            assert math.isfinite(metrics["loss"]) and "tis_weight_mean" in metrics
            stats = trainer.optim_step()
            assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
    after = _masked_mean(trainer.logprobs(sequences)[0], masks[0])
    assert after > before + 0.2, f"{policy_loss}: preferred logprob {before:.4f} -> {after:.4f}"
    if ref is not None:
        assert "kl_ref" in metrics


@pytest.mark.parametrize("policy_loss", ["grpo", "gspo", "cispo"])
def test_single_update_step_takes_old_logprobs_from_its_own_pass(tiny_model_path, policy_loss, monkeypatch):
    """One optimizer step per training step (ppo_epochs = ppo_mini_batches = 1): ``train_on_batch`` runs no
    separate old-logprob forward, and the update equals the one with l_old from that forward (to 1e-5)."""
    from training.utils.rl.ppo import StepBatch, train_on_batch

    config = TrainerConfig(device="cpu", learning_rate=5e-3, micro_batch_tokens=40, logprob_chunk_tokens=8)
    cfg = LossConfig(policy_loss=policy_loss, kl_beta=0.0)
    sequences, masks = _batch()
    total_tokens = sum(map(sum, masks))
    reference = PolicyTrainer(tiny_model_path, config)
    sampler = [[(lp - 0.05) * m for lp, m in zip(lps, mask)] for lps, mask in zip(reference.logprobs(sequences), masks)]

    old = reference.logprobs(sequences)  # the separate forward, as every step with several updates runs it
    expected = reference.forward_backward(sequences, _loss_fn(cfg, old, sampler, None, masks, total_tokens, 4))
    expected_norm = reference.optim_step()["grad_norm"]

    trainer = PolicyTrainer(tiny_model_path, config)
    monkeypatch.setattr(trainer, "logprobs", lambda *a, **k: pytest.fail("a separate old-logprob forward ran"))
    batch = StepBatch(sequences, sampler, masks, list(ADVANTAGES), [1.0] * len(sequences))
    got = train_on_batch(trainer, batch, cfg)
    assert expected_norm > 1e-3  # a real update to compare
    assert got["train/loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
    assert got["train/grad_norm"] == pytest.approx(expected_norm, rel=1e-5)
    assert got["train/tis_weight_mean"] == pytest.approx(expected["tis_weight_mean"], rel=1e-5)
    for (name, p), q in zip(trainer.model.named_parameters(), reference.model.parameters()):
        assert (p - q).abs().max().item() <= 1e-5, name
