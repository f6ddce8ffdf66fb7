"""Exactness: sampler logprobs vs trainer logprobs of the same sampled tokens, fp32 and bf16.

    python -m benchmarks.exactness [--models tiny,smollm2] [--quick]

The embedded server samples (temperature 1, ``ignore_eos``) ``--repeats`` batches of requests
(tiny: 16 × 64 tokens per batch, SmolLM2: 8 × 48) with random prompts; the trainer
(``PolicyTrainer.logprobs``, temperature 1) scores the same token ids. Per batch: mean and max of
|ℓ_sampler − ℓ_trainer| and the mismatch KL in the k3 form of
``training/utils/rl/losses/common.py`` (exp(d) − d − 1, d = ℓ_trainer − ℓ_sampler, mean over
sampled tokens); the figure is the median over batches. Settings: engine fp32 / trainer fp32 (the
baseline), engine bf16 / trainer fp32, engine bf16 / trainer bf16 (params and compute); the ratio
is each setting's figure / the fp32 one.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import urllib.request

from benchmarks.common import base_parser, emit, median, model_path, row

WORKLOAD = {"tiny": (16, 64), "smollm2": (8, 48), "quick": (8, 32)}


def sample(path: str, dtype: str, batches: int, n: int, tokens: int, vocab: int) -> tuple[list[list], str]:
    """``batches`` lists of (full token ids, prompt length, sampler logprobs); the server's execution path."""
    from training.deployment.backends.embedded import EmbeddedDeployment
    from training.deployment.client import DeploymentSampler
    from training.utils import DeployConfig, EngineConfig

    rng = random.Random(0)
    with EmbeddedDeployment(
        path, DeployConfig(engine_config=EngineConfig(max_batch_size=n, max_model_len=256, dtype=dtype))
    ) as dep:
        with urllib.request.urlopen(f"{dep.base_url}/stats", timeout=30) as r:
            execution_path = json.load(r)["execution_path"]

        async def run() -> list[list]:
            sampler = DeploymentSampler(dep.base_url, timeout_s=1200)
            out = []
            try:
                for b in range(batches):
                    prompts = [[rng.randrange(3, min(vocab, 500)) for _ in range(rng.randint(8, 32))] for _ in range(n)]
                    comps = await asyncio.gather(
                        *[
                            sampler.sample_with_prompt_tokens(
                                p, max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=1000 * b + i
                            )
                            for i, p in enumerate(prompts)
                        ]
                    )
                    out.append([(c.full_tokens, c.prompt_len, c.inference_logprobs) for (c,) in comps])
            finally:
                await sampler.close()
            return out

        return asyncio.run(run()), execution_path


def compare(trainer, batch: list) -> dict[str, float]:
    """Mean / max |Δ| and mean k3 mismatch KL over the batch's sampled tokens."""
    scored = trainer.logprobs([full for full, _, _ in batch], temperature=1.0)
    diffs = []
    for (_, plen, lps), lt in zip(batch, scored):
        diffs += [t - s for t, s in zip(lt[plen:], lps)]
    return {
        "mean_abs": sum(abs(d) for d in diffs) / len(diffs),
        "max_abs": max(abs(d) for d in diffs),
        "k3": sum(math.exp(d) - d - 1 for d in diffs) / len(diffs),
        "tokens": len(diffs),
    }


def bench_model(name: str, repeats: int, n: int, tokens: int) -> list[dict]:
    from transformers import AutoConfig

    from training.trainer import PolicyTrainer
    from training.utils import TrainerConfig

    path = model_path(name)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    fp32_trainer = PolicyTrainer(path, TrainerConfig(device="cpu", dtype="float32", compute_dtype="float32"))
    bf16_trainer = PolicyTrainer(path, TrainerConfig(device="cpu", dtype="bfloat16", compute_dtype="bfloat16"))
    samples, paths = {}, {}
    for dt in ("float32", "bfloat16"):
        samples[dt], paths[dt] = sample(path, dt, repeats, n, tokens, vocab)
    settings = {
        "engine fp32, trainer fp32": [compare(fp32_trainer, b) for b in samples["float32"]],
        "engine bf16, trainer fp32": [compare(fp32_trainer, b) for b in samples["bfloat16"]],
        "engine bf16, trainer bf16": [compare(bf16_trainer, b) for b in samples["bfloat16"]],
    }
    engine_path = {s: paths["float32" if s.startswith("engine fp32") else "bfloat16"] for s in settings}
    base = {k: median([m[k] for m in settings["engine fp32, trainer fp32"]]) for k in ("mean_abs", "max_abs", "k3")}
    total = sum(m["tokens"] for m in settings["engine fp32, trainer fp32"])
    rows = []
    for setting, ms in settings.items():
        for key, unit in (
            ("mean_abs", "mean abs Δlogprob"),
            ("max_abs", "max abs Δlogprob"),
            ("k3", "mismatch KL (k3)"),
        ):
            rows.append(
                row(
                    f"{name}: {setting} ({total} tokens)",
                    median([m[key] for m in ms]),
                    unit,
                    "engine fp32, trainer fp32",
                    base[key],
                    engine_execution_path=engine_path[setting],
                )
            )
    return rows


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--models", default="tiny,smollm2")
    a = p.parse_args()
    started = time.perf_counter()
    rows = []
    for name in ["tiny"] if a.quick else a.models.split(","):
        n, tokens = WORKLOAD["quick" if a.quick else name]
        rows += bench_model(name, a.repeats, n, tokens)
    bf16 = next(
        i for i, r in enumerate(rows) if "engine bf16, trainer fp32" in r["name"] and r["unit"].startswith("mean")
    )
    emit(
        "exactness",
        rows,
        headline=bf16,
        notes="Lower is better; ratio = this setting / fp32.",
        started=started,
        repeats=a.repeats,
    )


if __name__ == "__main__":
    main()
