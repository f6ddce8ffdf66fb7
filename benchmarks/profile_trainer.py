"""Where a trainer step's time goes: ``torch.profiler`` on one GRPO-shaped step, by kind of work.

    python -m benchmarks.profile_trainer [--model smollm2] [--prompt-ratio 1]

Three configurations on the same batch (the SmolLM2 GRPO shape of ``trainer_throughput``):
ordinary packing with full fine-tuning (before issue #20), shared-prompt packing with full
fine-tuning (the default now), and shared-prompt packing with LoRA. Each runs one profiled
``forward_backward`` (no warm-up pass: on SmolLM2 a pass takes tens of seconds, first-call costs
are small against that), one untimed ``optim_step`` (AdamW's state appears there), then a timed
``optim_step`` on zero gradients (the same work). CPU self time of every op is put into one bucket:

- ``LM head + log-softmax``: the chunked logprobs (the LM head matmuls, recomputed in backward
  because the chunks are checkpointed, the fp32 ``log_softmax`` / ``logsumexp`` / ``gather``);
- ``attention (sdpa)``: the ``scaled_dot_product_attention`` kernels, forward and backward;
- ``other matmuls``: projections and MLP, forward and backward (LoRA's small ones included);
- ``elementwise, norms, copies``: everything else the profiler saw (activations, RMSNorm, RoPE,
  concatenations, the masks ``transformers`` builds, autograd bookkeeping);
- ``optimizer (AdamW)``: wall time of ``optim_step`` (clipping, the update, zeroing).

Prints a JSON line per configuration and a Markdown table. Not part of ``run_all``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import model_path
from benchmarks.trainer_throughput import GRPO_SHAPES, grpo_sequences

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
ATTENTION = ("scaled_dot_product", "flash_attention")
LOGSOFTMAX = ("log_softmax", "logsumexp", "aten::gather", "aten::_log_softmax")
CONFIGS = {
    "ordinary packing, full fine-tuning": dict(shared_prompt_packing=False),
    "shared-prompt packing, full fine-tuning": dict(),
    "shared-prompt packing, LoRA r=16": dict(lora_rank=16),
}


def bucket(name: str, shapes: list, vocab: int) -> str:
    if any(a in name for a in ATTENTION):
        return "attention (sdpa)"
    if any(name.startswith(m) for m in MATMULS):
        if any(vocab in s for s in shapes if s):
            return "LM head + log-softmax"
        return "other matmuls"
    if any(k in name for k in LOGSOFTMAX):
        return "LM head + log-softmax"
    return "elementwise, norms, copies"


def profile_config(path: str, seqs: list[list[int]], micro_batch_tokens: int, overrides: dict) -> dict:
    from training.trainer import PolicyTrainer
    from training.utils import TrainerConfig

    trainer = PolicyTrainer(
        path, TrainerConfig(device="cpu", micro_batch_tokens=micro_batch_tokens, learning_rate=1e-6, **overrides)
    )
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    trained = sum(len(s) - 1 for s in seqs)

    def loss_fn(packed, logprobs_N):
        return -logprobs_N.sum() / trained, {}

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        trainer.forward_backward(seqs, loss_fn)
        fb_s = time.perf_counter() - t0
    trainer.optim_step()  # creates AdamW's state; the timed step below is a steady-state one
    for param in trainer.model.parameters():
        if param.requires_grad:  # same work as a real step: clipping and the update do not look at the values
            param.grad = torch.zeros_like(param)
    t0 = time.perf_counter()
    trainer.optim_step()
    optim_s = time.perf_counter() - t0
    buckets: dict[str, float] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        shapes = [list(s) for s in (event.input_shapes or [])]
        key = bucket(event.key, shapes, vocab)
        buckets[key] = buckets.get(key, 0.0) + event.self_cpu_time_total / 1e6
    profiled = sum(buckets.values())
    # scale the profiler's self times to the wall time of forward_backward (profiling overhead aside)
    out = {k: v * fb_s / profiled for k, v in buckets.items()}
    out["optimizer (AdamW)"] = optim_s
    return {"seconds": out, "forward_backward_s": fb_s, "optim_s": optim_s, "trained_tokens": trained}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt-ratio", type=int, default=1)
    p.add_argument(
        "--configs",
        default=",".join(str(i) for i in range(len(CONFIGS))),
        help="which configurations to profile, by position: "
        + "; ".join(f"{i} = {name}" for i, name in enumerate(CONFIGS)),
    )
    a = p.parse_args()
    chosen = {name: CONFIGS[name] for i, name in enumerate(CONFIGS) if str(i) in a.configs.split(",")}
    path = model_path(a.model)
    groups, size, lo, hi, micro_batch_tokens = GRPO_SHAPES.get(a.model, GRPO_SHAPES["smollm2"])
    from transformers import AutoConfig

    vocab = min(AutoConfig.from_pretrained(path).vocab_size, 4000)
    seqs = grpo_sequences(groups, size, lo, hi, a.prompt_ratio, vocab)
    results = {}
    for name, overrides in chosen.items():
        results[name] = profile_config(path, seqs, micro_batch_tokens, overrides)
        print(json.dumps({"config": name, **results[name]}), flush=True)
    kinds = [
        "LM head + log-softmax",
        "attention (sdpa)",
        "other matmuls",
        "elementwise, norms, copies",
        "optimizer (AdamW)",
    ]
    print(
        f"\n{a.model}: {len(seqs)} sequences ({groups} groups x {size}, prompt {a.prompt_ratio}x completion), "
        f"{results[next(iter(chosen))]['trained_tokens']} trained tokens; seconds (share of the step)\n"
    )
    print("| kind | " + " | ".join(chosen) + " |")
    print("| --- |" + " --- |" * len(chosen))
    for kind in kinds + ["step"]:
        cells = []
        for name in chosen:
            sec = results[name]["seconds"]
            total = sum(sec.values())
            value = total if kind == "step" else sec.get(kind, 0.0)
            cells.append(f"{value:.2f} s" + ("" if kind == "step" else f" ({100 * value / total:.0f} %)"))
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
