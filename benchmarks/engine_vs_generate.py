"""Throughput of the engine vs transformers ``generate`` under concurrent load (CPU, fp32).

    python -m benchmarks.engine_vs_generate [--model tiny|smol|PATH] [--requests 32] [--hf-batch 32]
        [--block-size 16] [--engine-only]

N requests of mixed prompt (8..64) and output (16..64) lengths, eos ignored. The engine gets
them all at once through ``AsyncEngine.generate`` (continuous batching); ``generate`` runs them in
static batches of ``--hf-batch`` in arrival order, each batch left-padded and decoding to its
longest requested length (only requested tokens count). ``smol`` is a random-init Llama of
SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate 1536, vocab 49152,
tied), built once into the cache. Prints one JSON line: tok/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from benchmarks.engine_throughput import bench_generate as static_batches_tps
from benchmarks.engine_throughput import workload


def smol_shaped_model() -> str:
    """Path of a random-init Llama with SmolLM2-135M's shape (built once into the cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from training.models.build_tiny import ensure_tiny_model
    from training.utils.cache import cache_dir

    path = cache_dir() / "smol-shaped-llama"
    if not (path / "config.json").exists():
        tok = AutoTokenizer.from_pretrained(ensure_tiny_model("qwen3"))
        cfg = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
            rope_theta=100000.0,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
        tok.save_pretrained(path)
    return str(path)


def bench_engine(path: str, reqs, max_batch_size: int, block_size: int = 16) -> float:
    from training.deployment.engine import AsyncEngine, EngineConfig, SamplingParams

    async def main() -> float:
        config = EngineConfig(model=path, max_batch_size=max_batch_size, max_model_len=256, kv_block_size=block_size)
        eng = AsyncEngine(config)
        await eng.start()
        await eng.generate(reqs[0][0], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        res = await asyncio.gather(
            *[eng.generate(p, SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True)) for p, m in reqs]
        )
        dt = time.perf_counter() - t0
        await eng.shutdown()
        assert [len(r.output_token_ids) for r in res] == [m for _, m in reqs]
        return sum(m for _, m in reqs) / dt

    return asyncio.run(main())


def bench_generate(path: str, reqs, batch: int) -> float:
    """``engine_throughput.bench_generate`` on a freshly loaded model, after a warm-up batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    static_batches_tps(path, reqs[:2], 2, model)  # warm-up
    return static_batches_tps(path, reqs, batch, model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny, smol, or a model folder")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (EngineConfig.kv_block_size)")
    ap.add_argument("--engine-only", action="store_true", help="skip generate (for A/B runs of the engine alone)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from training.models.build_tiny import ensure_tiny_model

    path = {"tiny": ensure_tiny_model, "smol": smol_shaped_model}.get(a.model, lambda: a.model)()
    from transformers import AutoConfig

    reqs = workload(a.requests, (16, 64), AutoConfig.from_pretrained(path).vocab_size)
    engine_tps = bench_engine(path, reqs, max_batch_size=max(a.requests, 1), block_size=a.block_size)
    hf_tps = None if a.engine_only else bench_generate(path, reqs, a.hf_batch)
    print(
        json.dumps(
            {
                "model": Path(path).name,
                "requests": a.requests,
                "threads": torch.get_num_threads(),
                "block_size": a.block_size,
                "engine_tok_s": round(engine_tps, 1),
                "generate_tok_s": None if hf_tps is None else round(hf_tps, 1),
                "ratio": None if hf_tps is None else round(engine_tps / hf_tps, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
