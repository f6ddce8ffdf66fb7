"""Engine throughput: the embedded server over HTTP under concurrent clients vs ``generate`` and vs one at a time.

    python -m benchmarks.engine_throughput [--models tiny,smollm2] [--concurrency 8,32,64] [--quick]

Workload per concurrency C: ``C * per_client`` requests with mixed prompt lengths (8..64 random
ids) and completion lengths (tiny 16..64, SmolLM2 8..32 tokens), ``ignore_eos`` so every request
generates exactly its length, temperature 1. C client coroutines pull requests from one queue and
send them to ``/v1/completions`` of an ``EmbeddedDeployment`` (a child process, CPU; fp32, and for
SmolLM2 also bf16 with every baseline in bf16 too).

Baselines, measured in the same run on the same requests:
(a) ``transformers`` ``generate`` on static batches of C requests in arrival order, left-padded,
    each batch decoding to its longest requested length (only requested tokens count);
(b) the same server with one request at a time (the first ``--sequential-requests`` requests);
(c) vLLM's CPU build (``scripts/setup_vllm.sh`` makes its venv; fp32, eager) serving the same
    model and the same requests, when its venv exists. vLLM's CPU attention does not support
    head_dim 16, so the tiny model has no vLLM row.
Figure: generated tokens/s, median of ``--repeats`` runs; ratios engine / (a) and engine / (b).
"""

from __future__ import annotations

import asyncio
import random
import time

import torch

from benchmarks.common import base_parser, emit, median, model_path, row

COMPLETION_RANGE = {"tiny": (16, 64), "smollm2": (8, 32)}


def workload(n: int, completion_range: tuple[int, int], vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, completion length) pairs, prompt 8..64 tokens."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, min(vocab, 500)) for _ in range(rng.randint(8, 64))], rng.randint(*completion_range))
        for _ in range(n)
    ]


async def _serve_clients(sampler, reqs: list[tuple[list[int], int]], clients: int) -> float:
    """Send ``reqs`` through ``clients`` concurrent coroutines; return generated tokens/s."""
    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    generated = 0

    async def client() -> None:
        nonlocal generated
        while not queue.empty():
            prompt, m = queue.get_nowait()
            (c,) = await sampler.sample_with_prompt_tokens(prompt, max_tokens=m, temperature=1.0, ignore_eos=True)
            if len(c.output_tokens) != m:
                raise RuntimeError(f"asked for {m} tokens, got {len(c.output_tokens)}")
            generated += m

    t0 = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(clients)])
    return generated / (time.perf_counter() - t0)


def bench_server(
    path: str, reqs_by_c: dict[int, list], repeats: int, sequential: list, engine: str = "embedded", dtype="float32"
) -> tuple[dict, list]:
    """Tokens/s per concurrency (one per repeat) and one-at-a-time tokens/s (one per repeat, none if not asked)."""
    from training.deployment.backends.registry import make_deployment
    from training.deployment.client import DeploymentSampler
    from training.utils import DeployConfig, EngineConfig

    max_c = max(reqs_by_c)
    cfg = DeployConfig(
        engine=engine,
        startup_timeout_s=600,
        engine_config=EngineConfig(max_batch_size=max_c, max_model_len=256, dtype=dtype),
    )
    with make_deployment(path, cfg) as dep:

        async def run() -> tuple[dict, list]:
            sampler = DeploymentSampler(dep.base_url, timeout_s=1200)
            try:
                await _serve_clients(sampler, reqs_by_c[min(reqs_by_c)][:4], 4)  # warm-up
                per_c = {
                    c: [await _serve_clients(sampler, reqs, c) for _ in range(repeats)] for c, reqs in reqs_by_c.items()
                }
                seq = [await _serve_clients(sampler, sequential, 1) for _ in range(repeats)] if sequential else []
                return per_c, seq
            finally:
                await sampler.close()

        return asyncio.run(run())


def bench_generate(path: str, reqs: list[tuple[list[int], int]], batch: int, model=None) -> float:
    """Tokens/s of ``generate`` on static left-padded batches of ``batch`` requests."""
    pad = 0

    def run(chunk):
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(m for _, m in chunk),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                eos_token_id=None,
                pad_token_id=pad,
            )

    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        run(reqs[i : i + batch])
    return sum(m for _, m in reqs) / (time.perf_counter() - t0)


def vllm_available() -> bool:
    """Whether vLLM's CPU build is installed (``.venv-vllm``, ``scripts/setup_vllm.sh``)."""
    from training.deployment.backends.vllm import VLLM_VENV_PYTHON

    return VLLM_VENV_PYTHON.exists()


def bench_model(
    name: str,
    concurrency: list[int],
    per_client: int,
    repeats: int,
    n_sequential: int,
    with_vllm: bool,
    dtype: str = "float32",
) -> list[dict]:
    """Rows for one model and dtype: per concurrency, engine vs generate, vs sequential and vs vLLM (all in ``dtype``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = model_path(name)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    lengths = COMPLETION_RANGE.get(name, (8, 32))
    reqs_by_c = {c: workload(c * per_client, lengths, vocab, seed=c) for c in concurrency}
    sequential = reqs_by_c[min(concurrency)][:n_sequential]
    per_c, seq = bench_server(path, reqs_by_c, repeats, sequential, dtype=dtype)
    vllm_per_c = bench_server(path, reqs_by_c, repeats, [], engine="vllm", dtype=dtype)[0] if with_vllm else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    bench_generate(path, reqs_by_c[min(concurrency)][:2], 2, model)  # warm-up
    rows = []
    seq_tps = median(seq)
    for c in concurrency:
        gen = median([bench_generate(path, reqs_by_c[c], c, model) for _ in range(repeats)])
        eng = median(per_c[c])
        label = f"{name}{'' if dtype == 'float32' else ' ' + dtype}: server, {c} clients ({len(reqs_by_c[c])} requests)"
        rows.append(row(label, eng, "generated tok/s", f"generate, static batches of {c}", gen))
        rows.append(row(label, eng, "generated tok/s", "same server, one request at a time", seq_tps))
        if c in vllm_per_c:
            rows.append(row(label, eng, "generated tok/s", "vLLM CPU build, same requests", median(vllm_per_c[c])))
    return rows


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--concurrency", default="8,32,64")
    p.add_argument("--per-client", type=int, default=0, help="requests per client (0: tiny 2, SmolLM2 1)")
    p.add_argument("--sequential-requests", type=int, default=8)
    p.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="weight dtypes for SmolLM2 (every side of a row in the same dtype); the tiny model runs float32 only",
    )
    p.add_argument(
        "--vllm",
        choices=["auto", "yes", "no"],
        default="auto",
        help="baseline (c); auto: when the venv of scripts/setup_vllm.sh exists",
    )
    a = p.parse_args()
    started = time.perf_counter()
    models, conc = a.models.split(","), [int(c) for c in a.concurrency.split(",")]
    if a.quick:
        models, conc, a.sequential_requests = ["tiny"], [8], 4
    with_vllm = a.vllm == "yes" or (a.vllm == "auto" and not a.quick and vllm_available())
    rows = []
    for m in models:
        per_client = a.per_client or (2 if m == "tiny" else 1)
        for dtype in ["float32"] if m == "tiny" or a.quick else a.dtypes.split(","):
            rows += bench_model(m, conc, per_client, a.repeats, a.sequential_requests, with_vllm and m != "tiny", dtype)
    notes = (
        "vLLM CPU baseline (c): "
        + (
            "measured for SmolLM2 (no tiny row: vLLM's CPU attention rejects head_dim 16)."
            if with_vllm
            else "not measured in this run (no venv from scripts/setup_vllm.sh)."
        )
        + " GPU rows: not measured (no GPU lent to this task)."
    )
    emit("engine_throughput", rows, headline=0, notes=notes, started=started, repeats=a.repeats)


if __name__ == "__main__":
    main()
