"""The fused LM head + log-softmax (``lm_head_logprobs.TargetLogprobs``): values and gradients equal a plain
full-logits reference and the checkpointed path it replaced, with tied weights, temperature, softcap, bias,
a frozen head (LoRA), shared-prompt packing and bf16 autocast."""

import pytest
import torch

from training.trainer import logprobs as logprobs_module
from training.trainer.lm_head_logprobs import compute_weight, fusable_head, target_logprobs, target_logprobs_nograd
from training.trainer.logprobs import packed_logprobs
from training.trainer.packing import pack_sequences
from training.utils.config import TrainerConfig

GROUP_PROMPT = [7, 3, 9, 1, 4, 4, 8]


def _reference(hidden, targets, weight, bias, temperature, softcap):
    """Full ``[M, V]`` fp32 logits, ``log_softmax``, gather: the definition, with autograd doing the backward."""
    logits = hidden @ weight.t() + (0 if bias is None else bias)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("frozen_head", [False, True])
def test_chunk_logprobs_and_gradients_equal_full_logits_reference(bias, temperature, softcap, frozen_head):
    torch.manual_seed(0)
    rows, hidden_size, vocab = 11, 16, 97
    head = torch.nn.Linear(hidden_size, vocab, bias=bias)
    head.weight.data *= 4  # logits of a few units: a peaked softmax, where sloppy algebra shows
    head.requires_grad_(not frozen_head)
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    upstream = torch.randn(rows)

    got = target_logprobs(hidden, targets, head, compute_weight(head.weight), temperature, softcap)
    (got * upstream).sum().backward()
    got_grads = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters() if p.requires_grad]
    hidden.grad = None
    head.zero_grad(set_to_none=True)

    want = _reference(hidden, targets, head.weight, head.bias, temperature, softcap)
    (want * upstream).sum().backward()
    want_grads = [hidden.grad] + [p.grad for p in head.parameters() if p.requires_grad]

    assert len(got_grads) == (1 if frozen_head else 2 + bias)
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)
    for g, w in zip(got_grads, want_grads):
        assert w.abs().max() > 0
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    nograd = target_logprobs_nograd(hidden, targets, head, head.weight, temperature, softcap)
    assert torch.equal(nograd, got.detach())  # scoring and training see the same bits: the PPO ratio starts at 1


def test_tied_weight_gets_the_sum_of_embedding_and_head_gradients():
    """SmolLM2 ties its LM head to the input embeddings: one Parameter, two uses, one summed gradient."""
    torch.manual_seed(1)
    vocab, hidden_size = 50, 8
    embed = torch.nn.Embedding(vocab, hidden_size)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    head.weight = embed.weight
    ids = torch.randint(0, vocab, (9,))

    def loss(fused: bool):
        hidden = torch.tanh(embed(ids[:-1]))
        if fused:
            lp = target_logprobs(hidden, ids[1:], head, compute_weight(head.weight), 0.9, None)
        else:
            lp = _reference(hidden, ids[1:], head.weight, None, 0.9, None)
        return -lp.sum()

    loss(True).backward()
    fused_grad = embed.weight.grad.clone()
    embed.weight.grad = None
    loss(False).backward()
    torch.testing.assert_close(fused_grad, embed.weight.grad, atol=1e-5, rtol=1e-5)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("share_prefixes", [False, True])
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_model_logprobs_and_gradients_equal_the_checkpointed_path(
    tiny_model_path, monkeypatch, share_prefixes, lora_rank
):
    """On the tiny (tied) Qwen3, packed and shared-prompt layouts, full fine-tuning and LoRA (frozen head):
    the fused function against the per-chunk ``torch.utils.checkpoint`` path it replaced, to 1e-5."""
    from training.trainer import PolicyTrainer

    if lora_rank:
        pytest.importorskip("peft")
    trainer = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu", lora_rank=lora_rank))
    model = trainer.model
    assert fusable_head(model.get_output_embeddings())
    sequences = [GROUP_PROMPT + [11, 12, 13], GROUP_PROMPT + [21, 22], [5, 6, 7, 8, 9, 10], GROUP_PROMPT + [31]]
    (packed,) = pack_sequences(sequences, 4096, share_prefixes)
    assert (packed.shared is not None) == share_prefixes
    weights = packed.gather([[float((3 * i + t) % 5 - 2) for t in range(len(s))] for i, s in enumerate(sequences)])

    def run():
        logprobs_N = packed_logprobs(model, packed, chunk_tokens=5, temperature=0.8)
        (weights * logprobs_N).sum().backward()
        grads = _grads(model)
        model.zero_grad(set_to_none=True)
        return logprobs_N.detach(), grads

    fused_lp, fused_grads = run()
    monkeypatch.setattr(logprobs_module, "fusable_head", lambda head: False)
    plain_lp, plain_grads = run()
    torch.testing.assert_close(fused_lp, plain_lp, atol=1e-5, rtol=0)
    assert sorted(fused_grads) == sorted(plain_grads)
    if not lora_rank:
        assert "model.embed_tokens.weight" in fused_grads  # the tied head's gradient reached the shared weight
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_head_that_is_not_a_plain_linear_runs_through_its_own_forward():
    class ScaledHead(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    assert fusable_head(torch.nn.Linear(4, 8))
    assert not fusable_head(ScaledHead(4, 8))
    assert not fusable_head(torch.nn.Sequential(torch.nn.Linear(4, 8)))


def test_autocast_runs_the_head_in_bf16_and_the_log_softmax_in_fp32():
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 97, bias=False)
    hidden = torch.randn(6, 16, requires_grad=True)
    targets = torch.randint(0, 97, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weight_c = compute_weight(head.weight)
        got = target_logprobs(hidden, targets, head, weight_c, 1.0, None)
    assert weight_c.dtype == torch.bfloat16 and not weight_c.requires_grad
    assert got.dtype == torch.float32
    got.sum().backward()
    assert hidden.grad.dtype == torch.float32 and head.weight.grad.dtype == torch.float32
    want = _reference(hidden.detach(), targets, head.weight.detach(), None, 1.0, None)
    gap = (got.detach() - want).abs().max().item()
    assert 0 < gap < 0.05  # bf16 logits: close to, not equal to, fp32
