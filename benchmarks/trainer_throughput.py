"""Trainer throughput: packed micro-batches (``PolicyTrainer.forward_backward``) vs a padded HF forward.

    python -m benchmarks.trainer_throughput [--models tiny,smollm2] [--quick]

Workload: one mixed-length batch of random token sequences (tiny: 16 sequences of 32..512 tokens;
SmolLM2: 8 of 16..192), the same loss on both sides: L = -sum(logprob of each token given its
prefix) / (trained tokens), i.e. a token-mean over every position but each sequence's first.
- packed: ``PolicyTrainer.forward_backward`` (no padding, per-sequence causal sdpa, chunked
  logprobs), ``micro_batch_tokens`` 4096;
- padded (baseline): plain ``AutoModelForCausalLM`` forward on one right-padded batch with an
  attention mask, full-vocabulary ``log_softmax``, the same loss.
Each variant runs in its own subprocess: trained tokens/s is the median of ``--repeats`` timed
forward+backward passes after one untimed first pass; peak memory is the growth of the process's
max RSS (``getrusage``) over that first pass, relative to the state after loading the model.
On a GPU the same would use ``torch.cuda.max_memory_allocated`` and report MFU (not measured here).
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import time

import torch

from benchmarks.common import base_parser, emit, median, model_path, row

SHAPES = {"tiny": (16, 32, 512), "smollm2": (8, 16, 192), "quick": (8, 16, 128)}


def sequences(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def run_variant(variant: str, path: str, shape: tuple[int, int, int], repeats: int) -> dict:
    """Inside the subprocess: load, one first pass (memory), ``repeats`` timed passes."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    seqs = sequences(*shape, vocab=min(vocab, 4000))
    trained = sum(len(s) - 1 for s in seqs)
    if variant == "packed":
        from training.utils import TrainerConfig
        from training.trainer import PolicyTrainer

        trainer = PolicyTrainer(path, TrainerConfig(device="cpu", micro_batch_tokens=4096))

        def loss_fn(packed, logprobs_N):
            return -logprobs_N.sum() / trained, {}

        def step() -> None:
            trainer.forward_backward(seqs, loss_fn)
            trainer.optimizer.zero_grad(set_to_none=True)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        model.train()
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])

        def step() -> None:
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(logprobs * mask[:, 1:]).sum() / trained
            loss.backward()
            model.zero_grad(set_to_none=True)

    rss0 = _max_rss_mb()
    step()
    peak_mb = _max_rss_mb() - rss0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"tok_s": trained / median(times), "peak_mb": peak_mb, "tokens": trained,
            "padded_tokens": len(seqs) * max(len(s) for s in seqs)}


def measure(variant: str, path: str, shape: tuple[int, int, int], repeats: int) -> dict:
    """Run one variant in a fresh subprocess (so its max RSS is its own)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.trainer_throughput", "--variant", variant,
                          "--path", path, "--shape", ",".join(map(str, shape)), "--repeats", str(repeats)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} subprocess failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--variant", choices=["packed", "padded"], help="internal: run one variant and print its result")
    p.add_argument("--path")
    p.add_argument("--shape")
    a = p.parse_args()
    if a.variant:
        print(json.dumps(run_variant(a.variant, a.path, tuple(int(x) for x in a.shape.split(",")), a.repeats)))
        return
    started = time.perf_counter()
    rows = []
    for name in (["tiny"] if a.quick else a.models.split(",")):
        shape = SHAPES["quick"] if a.quick else SHAPES.get(name, SHAPES["smollm2"])
        path = model_path(name)
        packed, padded = measure("packed", path, shape, a.repeats), measure("padded", path, shape, a.repeats)
        desc = f"{name}: {shape[0]} seqs of {shape[1]}..{shape[2]} tokens ({packed['tokens']} trained, " \
               f"{packed['padded_tokens']} padded)"
        rows.append(row(f"{desc}, packed", packed["tok_s"], "trained tok/s", "padded HF forward", padded["tok_s"]))
        rows.append(row(f"{desc}, packed", packed["peak_mb"], "peak extra RSS MB", "padded HF forward",
                        padded["peak_mb"]))
    emit("trainer_throughput", rows, notes="GPU rows (peak CUDA memory, MFU): not measured, no GPU lent to this task.",
         started=started, repeats=a.repeats)


if __name__ == "__main__":
    main()
