"""Sampling cost: one engine sampling pass with each request field, against plain temperature sampling.

    python -m benchmarks.sampling_cost [--quick] [--repeats 5]

``training.deployment.engine.token_sampler.sample`` on a SmolLM2-shaped batch (32 rows × 49,152
vocabulary, fp32 random logits, rows with 64 prompt and 128 output tokens of history), every row
using the same fields. The variants are timed interleaved (one call of each per round, after one
untimed round); figure = median ms per call; ratio = variant / plain ``temperature=1`` in the same
run. The model's own decode step is not included: this isolates what the sampling fields add. The
last variant is plain temperature sampling by the C sampler the engine uses with its native step.
"""

from __future__ import annotations

import random
import time

import torch

from benchmarks.common import base_parser, emit, median, row

VARIANTS = {
    "temperature=1 (baseline)": {},
    "greedy": {"temperature": 0.0},
    "top_p=0.9": {"top_p": 0.9},
    "top_k=50": {"top_k": 50},
    "top_k=50, top_p=0.9, min_p=0.05": {"top_k": 50, "top_p": 0.9, "min_p": 0.05},
    "presence + frequency + repetition penalties": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
    },
    "logit_bias (8 tokens)": {"logit_bias": {t: 2.0 for t in range(8)}},
    "min_tokens (not yet reached)": {"min_tokens": 1000},
    "top_logprobs=5": {"top_logprobs": 5},
    "temperature=1, C sampler (the native step's)": {},
}
NATIVE = {"temperature=1, C sampler (the native step's)"}
"""Variants drawn by native.py's C sampler (``sample(..., native=True)``: plain rows only), when it builds here."""


def main() -> None:
    args = base_parser(__doc__).parse_args()
    from training.deployment.engine.requests import SamplingParams
    from training.deployment.engine.runners.native import native_available
    from training.deployment.engine.token_sampler import sample
    from training.deployment.engine.sequence import Sequence

    native_ok = native_available(torch.device("cpu"), torch.float32) is None
    variants = {name: fields for name, fields in VARIANTS.items() if native_ok or name not in NATIVE}

    started = time.perf_counter()
    batch, vocab = (8, 4096) if args.quick else (32, 49152)
    rng = random.Random(0)
    torch.manual_seed(0)
    logits = torch.randn(batch, vocab) * 3
    seqs = {}
    for name, fields in variants.items():
        params = SamplingParams(max_tokens=2000, **fields)
        rows = []
        for i in range(batch):
            seq = Sequence(
                [rng.randrange(vocab) for _ in range(64)], params, torch.Generator().manual_seed(i), frozenset({0, 1})
            )
            for _ in range(128):
                seq.append(rng.randrange(vocab), 0.0, 0)
            rows.append(seq)
        seqs[name] = rows
    times = {name: [] for name in variants}
    for r in range(max(args.repeats, 3) + 1):
        for name, rows in seqs.items():
            t0 = time.perf_counter()
            sample(logits, rows, name in NATIVE)
            if r:  # the first round warms up
                times[name].append((time.perf_counter() - t0) * 1e3)
    base_name = next(iter(VARIANTS))
    base = median(times[base_name])
    rows_out = [
        row(f"{batch}×{vocab}: {name}", median(t), "ms per step (lower is better)", base_name, base)
        for name, t in times.items()
    ]
    emit(
        "sampling_cost",
        rows_out,
        headline=5,
        started=started,
        repeats=max(args.repeats, 3),
        notes=f"batch {batch}, vocabulary {vocab}, fp32 CPU, {torch.get_num_threads()} threads",
    )


if __name__ == "__main__":
    main()
