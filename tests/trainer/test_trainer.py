"""PolicyTrainer and ReferenceModel on the tiny model: logprob exactness, gradients, steps, export."""

import math
import random

import pytest
import torch
from safetensors.torch import load_file

from training.trainer import PolicyTrainer, ReferenceModel, combine_metrics, resolve_device, resolve_dtype
from training.trainer.logprobs import packed_logprobs
from training.trainer.packing import pack_sequences
from training.utils.config import TrainerConfig

LENGTHS = [5, 31, 17, 2, 48, 1, 23]


def _sequences(lengths=LENGTHS, seed=0, vocab=400):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _plain_logprobs(model, seq, temperature=1.0):
    """Reference: full fp32 logits of one unpacked sequence, log_softmax, gather; [0] = 0."""
    logits = model(torch.tensor([seq])).logits[0].float() / temperature
    logp = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), logp])


def _trainer(path, **overrides):
    cfg = dict(device="cpu", learning_rate=1e-2, micro_batch_tokens=4096, logprob_chunk_tokens=1024)
    cfg.update(overrides)
    return PolicyTrainer(path, TrainerConfig(**cfg))


def _mask_loss(masks, total_tokens):
    """-sum(mask · logprob) / total_tokens: a step-wide denominator, so micro-batch grads add up."""

    def loss_fn(packed, logprobs_N):
        mask_N = packed.gather(masks)
        loss = -(mask_N * logprobs_N).sum() / total_tokens
        lp_N = logprobs_N.detach()
        return loss, {
            "masked_logprob_mean": float((mask_N * lp_N).sum() / mask_N.sum().clamp(min=1)),
            "logprob_max": float(lp_N.max()),
        }

    return loss_fn


@pytest.mark.parametrize(
    "micro_batch_tokens, chunk_tokens, temperature",
    [
        (4096, 1024, 1.0),  # everything in one pack, one chunk
        (4096, 3, 1.0),  # one pack, many chunks
        (40, 5, 1.0),  # several packs
        (1, 7, 1.0),  # every sequence alone
        (4096, 4, 0.7),  # temperature scaling
        (64, 1024, 1.6),
    ],
)
def test_logprobs_equal_plain_full_logits(tiny_model_path, micro_batch_tokens, chunk_tokens, temperature):
    trainer = _trainer(tiny_model_path, micro_batch_tokens=micro_batch_tokens, logprob_chunk_tokens=chunk_tokens)
    sequences = _sequences()
    got = trainer.logprobs(sequences, temperature=temperature)
    assert [len(g) for g in got] == LENGTHS
    with torch.no_grad():
        for seq, lp in zip(sequences, got):
            expected = _plain_logprobs(trainer.model, seq, temperature)
            assert lp[0] == 0.0
            assert (torch.tensor(lp) - expected).abs().max().item() < 1e-5


def test_chunked_checkpointed_gradients_equal_plain_gradients(tiny_model_path):
    trainer = _trainer(tiny_model_path)
    model = trainer.model
    sequences = _sequences()
    rng = torch.Generator().manual_seed(1)
    weights = [torch.randn(len(s), generator=rng).tolist() for s in sequences]
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ]
    params = dict(model.named_parameters())

    packed = pack_sequences(sequences, 4096)[0]
    assert packed.num_sequences == len(sequences)
    loss = (packed.gather(weights) * packed_logprobs(model, packed, chunk_tokens=4)).sum()
    loss.backward()
    chunked = {n: params[n].grad.clone() for n in names}
    model.zero_grad(set_to_none=True)

    loss = sum((torch.tensor(w) * _plain_logprobs(model, s)).sum() for s, w in zip(sequences, weights))
    loss.backward()
    for n in names:
        assert params[n].grad.abs().max() > 0
        torch.testing.assert_close(chunked[n], params[n].grad, atol=1e-5, rtol=1e-4)


def test_forward_backward_passes_aligned_logprobs_with_grad(tiny_model_path):
    trainer = _trainer(tiny_model_path, micro_batch_tokens=50, logprob_chunk_tokens=6)
    sequences = _sequences()
    expected = trainer.logprobs(sequences)
    seen = {}

    def loss_fn(packed, logprobs_N):
        assert logprobs_N.requires_grad and logprobs_N.dtype == torch.float32
        assert logprobs_N.shape == packed.input_ids_N.shape
        assert torch.all(logprobs_N[packed.is_sequence_start_N()] == 0)
        for i, lp in zip(packed.sample_indices, packed.split(logprobs_N.detach())):
            seen[i] = lp.tolist()
        return logprobs_N.sum() * 0.0, {"n": float(packed.num_tokens)}

    trainer.forward_backward(sequences, loss_fn)
    assert sorted(seen) == list(range(len(sequences)))
    for i, lp in seen.items():
        assert max(abs(a - b) for a, b in zip(lp, expected[i])) < 1e-5


def test_training_raises_preferred_sequence_logprob(tiny_model_path):
    trainer = _trainer(tiny_model_path)
    sequences = _sequences([20, 24])
    masks = [[0] * 8 + [1] * 12, [0] * 24]
    loss_fn = _mask_loss(masks, total_tokens=12)

    def preferred_mean():
        return sum(lp * m for lp, m in zip(trainer.logprobs(sequences)[0], masks[0])) / 12

    before = preferred_mean()
    losses = []
    for _ in range(4):
        metrics = trainer.forward_backward(sequences, loss_fn)
        losses.append(metrics["loss"])
        stats = trainer.optim_step()
        assert stats["grad_norm"] > 0 and stats["learning_rate"] == 1e-2
    after = preferred_mean()
    assert after > before + 0.5, (before, after)
    assert losses[-1] < losses[0]


def test_two_micro_batches_accumulate_to_one_batch_gradient(tiny_model_path):
    sequences = _sequences([30, 26, 21])
    masks = [[0] * 10 + [1] * 20, [0] * 6 + [1] * 20, [1] * 21]
    loss_fn = _mask_loss(masks, total_tokens=61)
    grads, metrics = [], []
    for micro_batch_tokens in (4096, 56):
        trainer = _trainer(tiny_model_path, micro_batch_tokens=micro_batch_tokens)
        assert len(pack_sequences(sequences, micro_batch_tokens)) == (1 if micro_batch_tokens == 4096 else 2)
        metrics.append(trainer.forward_backward(sequences, loss_fn))
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], abs=1e-6)


def test_combine_metrics_weights_by_tokens_and_takes_max():
    combined = combine_metrics(
        [({"a": 1.0, "x_max": 3.0, "y_min": 2.0}, 10), ({"a": 4.0, "x_max": 5.0, "y_min": -1.0}, 30)]
    )
    assert combined == {"a": pytest.approx(3.25), "x_max": 5.0, "y_min": -1.0}


def _norm_seen_by_step(trainer):
    """Wrap optimizer.step to record the global grad norm at the moment of the update."""
    seen = []
    original = trainer.optimizer.step

    def step(*args, **kwargs):
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return original(*args, **kwargs)

    trainer.optimizer.step = step
    return seen


@pytest.mark.parametrize("clip", [1e-3, 0.0])
def test_grad_norm_reported_and_clipped(tiny_model_path, clip):
    trainer = _trainer(tiny_model_path, grad_clip_norm=clip)
    seen = _norm_seen_by_step(trainer)
    sequences = _sequences([20, 24])
    trainer.forward_backward(sequences, _mask_loss([[1] * 20, [1] * 24], total_tokens=44))
    stats = trainer.optim_step()
    assert stats["grad_norm"] > 1e-2, "raw norm is reported, larger than the clip"
    expected_used = clip if clip > 0 else stats["grad_norm"]
    assert seen[0] == pytest.approx(expected_used, rel=1e-4)
    assert all(p.grad is None for p in trainer.model.parameters()), "grads zeroed after the step"


def test_update_skipped_and_warned_only_for_a_non_finite_grad_norm(tiny_model_path, caplog):
    trainer = _trainer(tiny_model_path)
    sequences = _sequences([20, 24])
    loss_fn = _mask_loss([[1] * 20, [1] * 24], total_tokens=44)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with caplog.at_level("WARNING", logger="training.trainer.trainer"):
        trainer.forward_backward(sequences, loss_fn)
        trainer.optim_step()
    assert "non-finite" not in caplog.text, "a finite step must not claim it was skipped"
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    trainer.forward_backward(sequences, loss_fn)
    next(p for p in trainer.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
    after_first = [p.detach().clone() for p in trainer.model.parameters()]
    with caplog.at_level("WARNING", logger="training.trainer.trainer"):
        stats = trainer.optim_step()
    assert "non-finite grad norm" in caplog.text
    assert not math.isfinite(stats["grad_norm"])
    assert all(torch.equal(a, b) for a, b in zip(after_first, trainer.model.parameters()))


def test_gradient_checkpointing_gives_same_gradients(tiny_model_path):
    sequences = _sequences([12, 9, 30])
    loss_fn = _mask_loss([[1] * 12, [1] * 9, [1] * 30], total_tokens=51)
    grads = []
    for checkpointing in (False, True):
        trainer = _trainer(tiny_model_path, gradient_checkpointing=checkpointing)
        trainer.forward_backward(sequences, loss_fn)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


def test_reference_model_is_frozen_while_policy_trains(tiny_model_path):
    cfg = TrainerConfig(device="cpu", learning_rate=1e-2)
    reference = ReferenceModel(tiny_model_path, cfg)
    policy = PolicyTrainer(tiny_model_path, cfg)
    assert all(not p.requires_grad for p in reference.model.parameters())
    assert not reference.model.training
    sequences = _sequences([15, 22])
    ref_before = reference.logprobs(sequences)
    assert ref_before == policy.logprobs(sequences)
    for _ in range(2):
        policy.forward_backward(sequences, _mask_loss([[1] * 15, [1] * 22], total_tokens=37))
        policy.optim_step()
    assert policy.logprobs(sequences) != ref_before
    assert reference.logprobs(sequences) == ref_before


def test_named_weights_match_saved_safetensors_and_reload(tiny_model_path, tmp_path):
    trainer = _trainer(tiny_model_path)
    sequences = _sequences([10, 14])
    trainer.forward_backward(sequences, _mask_loss([[1] * 10, [1] * 14], total_tokens=24))
    trainer.optim_step()
    weights = dict(trainer.named_weights())
    assert "lm_head.weight" not in weights, "tied lm_head is not stored in the checkpoint"
    assert all(not t.requires_grad for t in weights.values())
    out = trainer.save_pretrained(tmp_path / "export")
    saved = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(weights[name].cpu(), tensor), name
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    reloaded = _trainer(str(out))
    assert reloaded.logprobs(sequences) == trainer.logprobs(sequences)
    assert reloaded.tokenizer.encode("1 + 2") == trainer.tokenizer.encode("1 + 2")


def test_bad_input_is_rejected_with_field_name(tiny_model_path):
    trainer = _trainer(tiny_model_path)
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    with pytest.raises(ValueError, match=r"sequences\[1\]"):
        trainer.logprobs([[1, 2], [3, vocab]])
    with pytest.raises(ValueError, match=r"sequences\[0\]"):
        trainer.forward_backward([[]], _mask_loss([[]], 1))
    with pytest.raises(ValueError, match="temperature"):
        trainer.logprobs([[1, 2, 3]], temperature=0.0)
    with pytest.raises(ValueError, match="loss_fn"):
        trainer.forward_backward([[1, 2, 3]], lambda packed, lp: (lp, {}))


def test_resolve_device_and_dtype():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8", "cpu")
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            resolve_device("cuda:0")


def test_llama_packed_logprobs_equal_plain(tiny_llama_path):
    trainer = _trainer(tiny_llama_path, micro_batch_tokens=64, logprob_chunk_tokens=5)
    sequences = _sequences()
    got = trainer.logprobs(sequences, temperature=0.9)
    with torch.no_grad():
        for seq, lp in zip(sequences, got):
            assert (torch.tensor(lp) - _plain_logprobs(trainer.model, seq, 0.9)).abs().max().item() < 1e-5


def test_master_weights_are_float32_and_autocast_is_opt_in(tiny_model_path):
    """``dtype="auto"`` keeps float32 parameters; a bf16 compute dtype autocasts the forward only."""
    from training.trainer import PolicyTrainer
    from training.utils import TrainerConfig

    seq = [[1, 5, 9, 14, 20, 31]]
    plain = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu"))
    assert plain.dtype == torch.float32 and plain.compute_dtype == torch.float32
    mixed = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu", compute_dtype="bfloat16"))
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    a, b = plain.logprobs(seq)[0], mixed.logprobs(seq)[0]
    diff = max(abs(x - y) for x, y in zip(a, b))
    assert 0 < diff < 0.1  # bf16 compute: close to, but not bit-equal with, the fp32 forward


def test_thread_budget_is_asked_per_layer_forward_and_backward_and_changes_nothing_computed(tiny_model_path):
    """``share_cpu``: the budget is asked before every decoder layer's forward and backward pass, the calling
    thread's torch thread count follows it within one step, and losses and gradients equal the unshared run's."""
    seqs = _sequences(seed=3)
    masks = [[0] + [1] * (len(s) - 1) for s in seqs]
    total = sum(map(len, seqs))
    plain = _trainer(tiny_model_path)
    plain_metrics = plain.forward_backward(seqs, _mask_loss(masks, total))
    plain_grads = [p.grad.clone() for p in plain.model.parameters()]

    shared = _trainer(tiny_model_path)
    layers = shared.model.config.num_hidden_layers
    asked, seen = [], []
    shared.share_cpu(lambda: asked.append(None) or (1 if len(asked) <= layers else 2))
    for layer in shared.model.get_decoder().layers:  # what each layer's forward ran with
        layer.register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        metrics = shared.forward_backward(seqs, _mask_loss(masks, total))
        assert len(asked) == 2 * layers + 1  # the entry point, then each layer forward and backward
        assert seen == [1] * (layers - 1) + [2]  # layer hooks run before the recording hook
        assert torch.get_num_threads() == 2  # the last backward layer's budget
        assert metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-6)
        for g, p in zip(plain_grads, shared.model.parameters()):
            torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-5)
        asked.clear()
        shared.logprobs(seqs)  # no gradient: forward hooks only
        assert len(asked) == layers + 1
    finally:
        torch.set_num_threads(before)


def test_num_threads_sets_the_calling_threads_torch_threads(tiny_model_path):
    before = torch.get_num_threads()
    try:
        trainer = _trainer(tiny_model_path, num_threads=1)
        torch.set_num_threads(2)
        trainer.logprobs(_sequences())
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
