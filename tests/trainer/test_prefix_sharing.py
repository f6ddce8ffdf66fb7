"""Shared-prompt packing: groups found from token ids, and logprobs and gradients equal to ordinary packing."""

import random

import pytest
import torch

from training.trainer import PolicyTrainer
from training.trainer.logprobs import packed_logprobs
from training.trainer.model import load_causal_lm, prefix_sharing_supported
from training.trainer.packing import pack_sequences
from training.trainer.prefix_sharing import MIN_SHARED_PREFIX, prefix_groups
from training.utils.config import TrainerConfig


def _grpo_batch(shapes, seed=0, vocab=400, system=()):
    """Sequences of GRPO-shaped groups: ``shapes`` = [(prompt_len, [completion lengths])], shuffled."""
    rng = random.Random(seed)
    seqs, groups = [], []
    for prompt_len, completions in shapes:
        prompt = list(system) + [rng.randrange(3, vocab) for _ in range(prompt_len)]
        groups.append(len(prompt))
        for n in completions:
            seqs.append(prompt + [rng.randrange(3, vocab) for _ in range(n)])
    order = list(range(len(seqs)))
    rng.shuffle(order)
    return [seqs[i] for i in order]


# several groups with mixed prompt and completion lengths, a lone sequence, a group of two
SHAPES = [(12, [3, 17, 1, 9]), (40, [5, 2, 30]), (3, [8, 8]), (7, [25]), (1, [4, 6, 2]), (20, [11, 1, 14, 6, 2])]


def _trainer(path, **kw):
    cfg = dict(device="cpu", learning_rate=1e-2, micro_batch_tokens=4096, logprob_chunk_tokens=1024)
    cfg.update(kw)
    return PolicyTrainer(path, TrainerConfig(**cfg))


def test_prefix_groups_find_each_prompts_group_behind_a_common_system_prompt():
    system = [7, 8, 9, 10, 11]
    rng = random.Random(3)
    prompts = [[rng.randrange(20, 400) for _ in range(n)] for n in (6, 9, 4)]
    seqs = []
    for g, prompt in enumerate(prompts):
        for k in range(3):
            seqs.append(system + prompt + [500 + 10 * g + k, 1, 2])
    seqs.append(system + [1, 2, 3])  # shares only the system prompt
    seqs.append([42, 43])  # shares nothing
    seqs.append(list(seqs[0]))  # a duplicate of a group member
    groups = prefix_groups(seqs)
    assert sorted(i for members, _ in groups for i in members) == list(range(len(seqs)))
    by_first = {members[0]: (members, p) for members, p in groups}
    assert by_first[0] == ([0, 1, 2, 11], 11)  # system + prompt 0; the duplicate joins it
    assert by_first[3] == ([3, 4, 5], 14)
    assert by_first[6] == ([6, 7, 8], 9)
    assert by_first[9] == ([9], 0) and by_first[10] == ([10], 0)
    for members, p in groups:  # every member keeps at least one token of its own
        assert all(len(seqs[i]) > p for i in members)


def test_micro_batch_budget_counts_a_shared_prompt_once(tiny_model_path):
    seqs = _grpo_batch([(50, [10, 10, 10, 10])])
    plain = pack_sequences(seqs, 4096)
    shared = pack_sequences(seqs, 4096, share_prefixes=True)
    assert [p.num_compute_tokens for p in plain] == [240]
    assert [p.num_compute_tokens for p in shared] == [50 + 40]
    # a budget smaller than the group cuts it into chunks that each share the prompt again
    chunks = pack_sequences(seqs, 75, share_prefixes=True)
    assert [p.num_compute_tokens for p in chunks] == [70, 70]
    assert sorted(i for p in chunks for i in p.sample_indices) == [0, 1, 2, 3]


def test_each_prompt_runs_through_the_model_once_per_group(tiny_model_path):
    trainer = _trainer(tiny_model_path)
    assert trainer.share_prefixes
    seqs = _grpo_batch(SHAPES)
    rows = []
    hook = trainer.model.get_input_embeddings().register_forward_hook(lambda m, i, o: rows.append(o.shape[1]))
    trainer.forward_backward(seqs, lambda packed, lp: (lp.sum() * 0.0, {}))
    hook.remove()
    shared = [(p, cs) for p, cs in SHAPES if len(cs) > 1 and p >= MIN_SHARED_PREFIX]
    alone = [(p, cs) for p, cs in SHAPES if (p, cs) not in shared]
    computed = sum(p + sum(cs) for p, cs in shared) + sum(p + c for p, cs in alone for c in cs)
    assert rows == [computed] and computed < sum(len(s) for s in seqs)


@pytest.mark.parametrize(
    "micro_batch_tokens, chunk_tokens, temperature",
    [
        (4096, 1024, 1.0),  # one micro-batch, one logprob chunk
        (4096, 7, 1.0),  # many chunks
        (60, 5, 0.8),  # micro-batch boundaries: groups cut into chunks, several packs
        (1, 64, 1.0),  # every unit alone
    ],
)
@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_logprobs_equal_ordinary_packing(
    tiny_model_path, tiny_llama_path, model, micro_batch_tokens, chunk_tokens, temperature
):
    path = tiny_model_path if model == "qwen3" else tiny_llama_path
    seqs = _grpo_batch(SHAPES, seed=1)
    shared = _trainer(path, micro_batch_tokens=micro_batch_tokens, logprob_chunk_tokens=chunk_tokens)
    plain = _trainer(
        path, micro_batch_tokens=micro_batch_tokens, logprob_chunk_tokens=chunk_tokens, shared_prompt_packing=False
    )
    assert shared.share_prefixes and not plain.share_prefixes
    got, expected = shared.logprobs(seqs, temperature), plain.logprobs(seqs, temperature)
    assert [len(g) for g in got] == [len(s) for s in seqs]
    assert all(g[0] == 0.0 for g in got)
    assert max(abs(a - b) for g, e in zip(got, expected) for a, b in zip(g, e)) <= 1e-5


@pytest.mark.parametrize("micro_batch_tokens", [4096, 60])
def test_gradients_equal_ordinary_packing(tiny_model_path, micro_batch_tokens):
    """Per-token weights make every position (prompt tokens too) carry gradient; the prompt's K/V
    and its tokens' logprobs are shared by the members, so their gradients must add up."""
    seqs = _grpo_batch(SHAPES, seed=2)
    rng = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s), generator=rng).tolist() for s in seqs]

    def loss_fn(packed, logprobs_N):
        return (packed.gather(weights) * logprobs_N).sum() / 100.0, {"lp_mean": float(logprobs_N.detach().mean())}

    grads, metrics = [], []
    for share in (True, False):
        trainer = _trainer(tiny_model_path, micro_batch_tokens=micro_batch_tokens, shared_prompt_packing=share)
        metrics.append(trainer.forward_backward(seqs, loss_fn))
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], abs=1e-5)
    assert metrics[0]["lp_mean"] == pytest.approx(metrics[1]["lp_mean"], abs=1e-5)
    for name in grads[1]:
        assert grads[1][name].abs().max() > 0, name
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4)


def test_sliding_window_model_falls_back_to_ordinary_packing(tiny_model_path):
    """A sliding window smaller than the prompt would make the shared layout wrong: the trainer
    does not share, and its logprobs are still those of a plain forward."""
    kw = dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=4)
    trainer = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu"), **kw)
    supported, reason = prefix_sharing_supported(trainer.model)
    assert not supported and "sliding_attention" in reason
    assert not trainer.share_prefixes
    seqs = _grpo_batch([(10, [3, 5, 4])])
    got = trainer.logprobs(seqs)
    with torch.no_grad():
        for seq, lp in zip(seqs, got):
            logits = trainer.model(torch.tensor([seq])).logits[0].log_softmax(-1)
            plain = logits[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            assert (torch.tensor(lp[1:]) - plain).abs().max() < 1e-5
    eager = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu"), attn_implementation="eager")
    assert not eager.share_prefixes and "eager" in prefix_sharing_supported(eager.model)[1]


def test_a_model_that_ignores_the_layout_fails_instead_of_training_on_wrong_logprobs(tiny_model_path):
    model = load_causal_lm(tiny_model_path, "cpu", torch.float32, attn_implementation="sdpa").eval()
    packed = pack_sequences(_grpo_batch([(10, [3, 5])]), 4096, share_prefixes=True)[0]
    assert packed.shared is not None
    with pytest.raises(RuntimeError, match="shared_prefix_layout"):
        packed_logprobs(model, packed, chunk_tokens=16)


@pytest.mark.parametrize("share", [True, False])
def test_packed_attention_never_needs_the_math_kernel_on_a_gqa_model(tiny_model_path, share):
    """The tiny Qwen3 has 4 query heads over 2 KV heads. With SDPA limited to the fused kernels
    (flash, memory-efficient) the packed and shared-prompt paths still run (no call pairs a mask
    with ``enable_gqa``, which on CUDA only the math kernel takes) and give the default's logprobs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    trainer = _trainer(tiny_model_path, micro_batch_tokens=4096, shared_prompt_packing=share)
    assert trainer.model.config.num_attention_heads > trainer.model.config.num_key_value_heads
    seqs = _grpo_batch(SHAPES, seed=4)
    expected = trainer.logprobs(seqs, 1.0)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        got = trainer.logprobs(seqs, 1.0)
    assert max(abs(a - b) for g, e in zip(got, expected) for a, b in zip(g, e)) <= 1e-5


def test_masked_attention_repeats_kv_heads_and_matches_enable_gqa():
    """``attend`` with a mask repeats the KV heads instead of passing ``enable_gqa``; same values."""
    from training.trainer.model import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 9, 8, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    mask = torch.rand(9, 9, generator=g) > 0.3
    mask[:, 0] = True  # every query sees a key
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(attend(q, k, v, mask=mask), expected, atol=1e-12)
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(attend(q, k, v), causal, atol=1e-12)


def test_packed_attention_reads_no_sequence_boundaries_back_from_the_device(tiny_model_path, monkeypatch):
    """The trainer passes the packed lengths as Python ints: no layer calls ``cu_seq_lens_q.tolist()``
    (on CUDA a host sync per layer)."""
    from training.trainer import logprobs as logprobs_module

    class NoReadBack(torch.Tensor):
        def tolist(self):
            raise AssertionError("cu_seq_lens_q read back from the device")

    arguments = logprobs_module._packing_arguments

    def guarded(model, packed):
        args = arguments(model, packed)
        if "cu_seq_lens_q" in args:
            args["cu_seq_lens_q"] = args["cu_seq_lens_q"].as_subclass(NoReadBack)
        return args

    monkeypatch.setattr(logprobs_module, "_packing_arguments", guarded)
    trainer = _trainer(tiny_model_path, shared_prompt_packing=False)
    seqs = _grpo_batch(SHAPES, seed=5)
    got = trainer.logprobs(seqs, 1.0)
    assert [len(x) for x in got] == [len(s) for s in seqs]
