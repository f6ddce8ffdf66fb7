"""Where a trainer step's time goes: ``torch.profiler`` on one GRPO-shaped step, by kind of work.

    python -m benchmarks.profile_trainer [--model smollm2] [--prompt-ratio 1] [--configs 0,1,2,3] [--threads 1]
        [--passes 3]

Four configurations on the same batch (the SmolLM2 GRPO shape of ``trainer_throughput``):
ordinary packing with full fine-tuning (before issue #20), shared-prompt packing with full
fine-tuning (the default now), shared-prompt packing with LoRA, and shared-prompt packing under
bf16 autocast (``compute_dtype="bfloat16"``). Each runs one untimed ``forward_backward`` (first-call
costs: oneDNN picks its bf16 kernels there), ``--passes`` profiled ``forward_backward`` passes (each
figure below is the median over them), one untimed ``optim_step`` (AdamW's state appears there), then
``--passes`` timed ``optim_step`` calls on zero gradients (the same work). Times are CPU seconds of the process (``time.process_time``), so that other jobs on a shared
machine inflate them less than wall time; run one thread (``--threads 1``, the default) on a shared
machine, where several OpenMP threads spin against other processes. CPU self time of every op is put
into one bucket:

- ``LM head + log-softmax``: every op with a vocabulary-sized input (the LM head matmuls, forward,
  recomputed and backward; ``log_softmax`` / ``softmax`` / ``logsumexp``; the ``[rows, vocab]``
  elementwise ops and copies; the cast of the head's weight), plus ``gather`` / ``log_softmax`` by name;
- ``attention (sdpa)``: the ``scaled_dot_product_attention`` kernels, forward and backward;
- ``other matmuls``: projections and MLP, forward and backward (LoRA's small ones included);
- ``copies and casts``: ``copy_`` / ``_to_copy`` of everything else (under autocast: each weight to
  bf16 in the forward, each weight gradient back to fp32 in the backward, activations both ways);
- ``elementwise, norms``: everything else the profiler saw (activations, RMSNorm, RoPE,
  concatenations, the masks ``transformers`` builds, autograd bookkeeping);
- ``optimizer (AdamW)``: CPU time of ``optim_step`` (clipping, the update, zeroing).

Prints a JSON line per configuration and a Markdown table. Not part of ``run_all``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import model_path
from benchmarks.trainer_throughput import GRPO_SHAPES, grpo_sequences

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
ATTENTION = ("scaled_dot_product", "flash_attention")
LOGSOFTMAX = ("log_softmax", "logsumexp", "aten::gather", "aten::_log_softmax")
COPIES = ("aten::copy_", "aten::_to_copy")
CONFIGS = {
    "ordinary packing, full fine-tuning": dict(shared_prompt_packing=False),
    "shared-prompt packing, full fine-tuning": dict(),
    "shared-prompt packing, LoRA r=16": dict(lora_rank=16),
    "shared-prompt packing, bf16 autocast": dict(compute_dtype="bfloat16"),
}
KINDS = [
    "LM head + log-softmax",
    "attention (sdpa)",
    "other matmuls",
    "copies and casts",
    "elementwise, norms",
    "optimizer (AdamW)",
]


def bucket(name: str, shapes: list, vocab: int) -> str:
    if any(a in name for a in ATTENTION):
        return "attention (sdpa)"
    if any(vocab in s for s in shapes if s) or any(k in name for k in LOGSOFTMAX):
        return "LM head + log-softmax"
    if any(name.startswith(m) for m in MATMULS):
        return "other matmuls"
    if name in COPIES:
        return "copies and casts"
    return "elementwise, norms"


def profile_config(
    path: str, seqs: list[list[int]], micro_batch_tokens: int, threads: int, passes: int, overrides: dict
) -> dict:
    from training.trainer import PolicyTrainer
    from training.utils import TrainerConfig

    cfg = TrainerConfig(
        device="cpu", micro_batch_tokens=micro_batch_tokens, learning_rate=1e-6, num_threads=threads, **overrides
    )
    trainer = PolicyTrainer(path, cfg)
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    trained = sum(len(s) - 1 for s in seqs)

    def loss_fn(packed, logprobs_N):
        return -logprobs_N.sum() / trained, {}

    trainer.forward_backward(seqs, loss_fn)  # warm-up: first-call costs stay out of the profile
    per_pass: list[dict[str, float]] = []
    for _ in range(passes):
        trainer.optimizer.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t0 = time.process_time()
            trainer.forward_backward(seqs, loss_fn)
            fb_s = time.process_time() - t0
        buckets = dict.fromkeys(KINDS[:-1], 0.0)
        for event in prof.key_averages(group_by_input_shape=True):
            shapes = [list(s) for s in (event.input_shapes or [])]
            buckets[bucket(event.key, shapes, vocab)] += event.self_cpu_time_total / 1e6
        profiled = sum(buckets.values())
        # the profiler's self times, scaled to the pass's CPU time (profiling overhead aside)
        per_pass.append({**{k: v * fb_s / profiled for k, v in buckets.items()}, "forward_backward": fb_s})
    trainer.optim_step()  # creates AdamW's state; the timed steps below are steady-state ones
    optim = []
    for _ in range(passes):
        for param in trainer.model.parameters():
            if param.requires_grad:  # same work as a real step: clipping and the update do not look at the values
                param.grad = torch.zeros_like(param)
        t0 = time.process_time()
        trainer.optim_step()
        optim.append(time.process_time() - t0)
    out = {k: statistics.median(p[k] for p in per_pass) for k in KINDS[:-1]}
    out["optimizer (AdamW)"] = statistics.median(optim)
    fb = [p["forward_backward"] for p in per_pass]
    return {"seconds": out, "forward_backward_s": fb, "optim_s": optim, "trained_tokens": trained}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt-ratio", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (TrainerConfig.num_threads)")
    p.add_argument("--passes", type=int, default=3, help="profiled passes per configuration (medians reported)")
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
        results[name] = profile_config(path, seqs, micro_batch_tokens, a.threads, a.passes, overrides)
        print(json.dumps({"config": name, **results[name]}), flush=True)
    print(
        f"\n{a.model}: {len(seqs)} sequences ({groups} groups x {size}, prompt {a.prompt_ratio}x completion), "
        f"{results[next(iter(chosen))]['trained_tokens']} trained tokens, {a.threads} thread(s); "
        "CPU seconds (share of the step)\n"
    )
    print("| kind | " + " | ".join(chosen) + " |")
    print("| --- |" + " --- |" * len(chosen))
    for kind in KINDS + ["step"]:
        cells = []
        for name in chosen:
            sec = results[name]["seconds"]
            total = sum(sec.values())
            value = total if kind == "step" else sec.get(kind, 0.0)
            cells.append(f"{value:.2f} s" + ("" if kind == "step" else f" ({100 * value / total:.0f} %)"))
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
