"""The engine's decode step against this machine's limits: attainable GEMM rate and memory bandwidth.

    python -m benchmarks.decode_roofline [--model smollm2] [--batches 8,32,64] [--context 160] [--dtypes float32,bfloat16]
        [--steps 12] [--quick] [--repeats 3]

Measured first, on this machine and in this process (torch's thread count, one thread per core):
- **attainable GEMM rate** per dtype: the best of ``torch.mm`` on large square matrices (2048 and 3072) and on
  the decode step's own largest weight shape at 512 rows (MLP gate_up: [512, hidden] × [hidden, 2·inter]),
  in GFLOP/s; the highest is the machine's compute roof for that dtype;
- **memory bandwidth**: ``dst.copy_(src)`` of a 512 MiB fp32 tensor (read + write bytes / time), the best of
  the repeats.

Then the decode step itself (``LLMEngine`` in process, the execution path ``build_runner`` picks for the dtype:
the C step in fp32 on CPU): ``batch`` requests of ``context`` prompt tokens generate with ``ignore_eos``;
once every row runs, ``steps`` decode steps are timed. Per step:
- FLOPs = 2 × (the decoder's matmul weights + the LM head) × rows + attention (4 × layers × heads × head_dim ×
  keys per row, summed over rows);
- bytes = the weights once (the step reads every weight) + the K/V the rows attend over.

Rows: achieved GFLOP/s of the decode step as a fraction of the attainable GEMM rate (``ratio``), with the
roofline bound max(FLOPs / GEMM rate, bytes / bandwidth) and the step's time as a multiple of it in each row.
A step far above both roofs has overhead to remove; a step at the bandwidth roof can only gain by reading
less (batching more rows per weight read).
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import base_parser, emit, median, model_path, row, sig

BANDWIDTH_MIB = 512


def gemm_gflops(dtype: torch.dtype, shapes: list[tuple[int, int, int]], repeats: int) -> dict[str, float]:
    """Best GFLOP/s of ``torch.mm`` per (m, k, n) shape (a warm-up call first)."""
    out = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        torch.mm(a, b)
        best = min(_time(lambda a=a, b=b: torch.mm(a, b)) for _ in range(max(3, repeats)))
        out[f"{m}x{k}x{n}"] = 2 * m * k * n / best / 1e9
    return out


def gemm_shapes(hf_config, quick: bool = False) -> list[tuple[int, int, int]]:
    """The (m, k, n) shapes whose best ``torch.mm`` rate is the attainable GEMM rate: large squares and the
    decode step's largest weight (MLP gate_up) at 512 rows."""
    big = [(512, 512, 512)] if quick else [(2048, 2048, 2048), (3072, 3072, 3072)]
    return big + [(512, hf_config.hidden_size, 2 * hf_config.intermediate_size)]


def bandwidth_gbs(repeats: int) -> float:
    """Best read + write bytes per second of one large copy, in GB/s."""
    n = BANDWIDTH_MIB * 2**20 // 4
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)
    best = min(_time(lambda: dst.copy_(src)) for _ in range(max(3, repeats)))
    return 2 * n * 4 / best / 1e9


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def phase_cost(hf_config, rows: int, keys: int, dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes read) of each part of one decode step of ``rows`` rows that each attend over ``keys``
    keys, keyed by the C step's phase names: the layers' matmuls and the LM head (2 FLOPs per weight per
    row; the weights read once), attention (4 FLOPs per query head per key per row; the K/V read)."""
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", heads) or heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    inter, vocab = hf_config.intermediate_size, hf_config.vocab_size
    layer_weights = layers * (h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * inter)
    return {
        "layer matmuls": (2.0 * layer_weights * rows, float(layer_weights * dtype.itemsize)),
        "attention": (
            4.0 * layers * heads * head_dim * keys * rows,
            float(2 * layers * kv_heads * head_dim * keys * rows * dtype.itemsize),
        ),
        "LM head": (2.0 * vocab * h * rows, float(vocab * h * dtype.itemsize)),
    }


def step_cost(hf_config, rows: int, keys: int, dtype: torch.dtype) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step of ``rows`` rows that each attend over ``keys`` keys."""
    parts = phase_cost(hf_config, rows, keys, dtype).values()
    return sum(f for f, _ in parts), sum(b for _, b in parts)


def decode_step_seconds(path: str, dtype: str, batch: int, context: int, steps: int) -> tuple[float, str]:
    """Median seconds per decode step once ``batch`` rows of ``context`` tokens run; the execution path."""
    from training.deployment.engine.engine import LLMEngine
    from training.deployment.engine.requests import SamplingParams
    from training.utils.config import EngineConfig

    engine = LLMEngine(
        EngineConfig(model=path, device="cpu", dtype=dtype, max_batch_size=batch, max_model_len=context + steps + 16)
    )
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(3, engine.vocab_size, (context,), generator=g).tolist()
        params = SamplingParams(max_tokens=steps + 8, temperature=1.0, seed=i, ignore_eos=True)
        engine.add(engine.make_sequence(prompt, params))
    while engine.scheduler.waiting or len(engine.scheduler.running) < batch:
        engine.step()  # admission and prefill (and the first decode steps)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return median(times), engine.execution_path.name


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", default="8,32,64")
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dtypes", default="float32,bfloat16")
    a = p.parse_args()
    if a.quick:
        a.model, a.batches, a.context, a.steps, a.dtypes = "tiny", "4", 32, 4, "float32"
    from transformers import AutoConfig

    started = time.perf_counter()
    path = model_path(a.model)
    cfg = AutoConfig.from_pretrained(path)
    bw = bandwidth_gbs(a.repeats)
    rows, roofs = [], {}
    for dtype_name in a.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        rates = gemm_gflops(dtype, gemm_shapes(cfg, a.quick), a.repeats)
        roofs[dtype_name] = {k: sig(v) for k, v in rates.items()}
        peak = max(rates.values())
        for batch in (int(b) for b in a.batches.split(",")):
            seconds, path_name = decode_step_seconds(path, dtype_name, batch, a.context, a.steps)
            flops, nbytes = step_cost(cfg, batch, a.context + a.steps // 2, dtype)
            bound = max(flops / (peak * 1e9), nbytes / (bw * 1e9))
            rows.append(
                row(
                    f"{dtype_name} decode step, batch {batch} × {a.context} keys ({path_name})",
                    flops / seconds / 1e9,
                    "GFLOP/s",
                    f"attainable {dtype_name} GEMM rate",
                    peak,
                    step_ms=sig(seconds * 1e3),
                    roofline_ms=sig(bound * 1e3),
                    times_roofline=sig(seconds / bound),
                    memory_bound_ms=sig(nbytes / (bw * 1e9) * 1e3),
                    compute_bound_ms=sig(flops / (peak * 1e9) * 1e3),
                    baseline_is_a_limit=True,
                )
            )
    headline = next((i for i, r in enumerate(rows) if "float32" in r["name"] and "batch 64" in r["name"]), 0)
    emit(
        "decode_roofline",
        rows,
        headline=headline,
        started=started,
        repeats=a.repeats,
        notes=(
            f"{a.model}; memory bandwidth {bw:.1f} GB/s (copy of {BANDWIDTH_MIB} MiB, read + write); attainable "
            f"GEMM rate per dtype = the best torch.mm shape (GFLOP/s): {roofs}. ratio = the decode step's achieved "
            "GFLOP/s / the attainable GEMM rate of its dtype; times_roofline = step time / max(compute, memory) bound"
        ),
        extra={"bandwidth_gbs": sig(bw), "gemm_gflops": roofs},
    )


if __name__ == "__main__":
    main()
