"""Engine on RL-shaped traffic: (a) decode-heavy and (b) GRPO-shaped, vs vLLM CPU and ``generate``, interleaved.

    python -m benchmarks.engine_rl_shapes [--model smollm2] [--clients 32,64] [--completions 64,256]
        [--groups 4] [--group-prompts 256,1024] [--repeats 3] [--vllm auto|yes|no] [--quick]

(a) decode-heavy: ``--clients`` concurrent clients (a row per count), one request each, prompts 32–128 random ids,
    completion lengths long-tailed in ``--completions`` (half at the low end, a tail up to the
    high end), ``ignore_eos``, T = 1. Servers: the embedded one (prefix caching on) and vLLM's
    CPU build; baseline ``transformers`` ``generate`` on one static left-padded batch of the same
    requests (to the longest length; only requested tokens count).
(b) GRPO-shaped: ``--groups`` prompts of 256–1024 random ids, 8 requests per prompt (what a GRPO
    group sends: ``completions_per_prompt`` requests with one prompt), all sent at once,
    completions 16–48 tokens. Servers: embedded with prefix caching, embedded without
    (``enable_prefix_caching=False``), vLLM CPU with its automatic prefix caching on (its default).
    Prompt tokens computed: the embedded server's ``prefill_tokens`` counter (``GET /stats``);
    vLLM's ``prefix_cache_queries - prefix_cache_hits`` from ``/metrics``.

Every server is up for the whole run, and each repeat runs the servers in rotated order on fresh
random prompts (so no repeat hits a cache filled by an earlier one), each side starting once the
CPUs are quiet (``wait_for_quiet_cpu``): ratios come from runs taken minutes apart on the same
machine. Figure: generated tokens/s (a) and wall time (b),
median of ``--repeats``; the spread (min–max over repeats) is in each row, every repeat's value (and
the prompt tokens (b) sent) under ``per_repeat`` in the JSON line.
"""

from __future__ import annotations

import asyncio
import random
import re
import time

import aiohttp
import torch

from benchmarks.common import base_parser, emit, median, model_path, row, sig, wait_for_quiet_cpu

GROUP_SIZE = 8


def decode_heavy(n: int, lo: int, hi: int, seed: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt 32–128 ids, completion length) pairs; lengths long-tailed in [lo, hi]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        m = rng.randint(lo, (lo + hi) // 2) if rng.random() < 0.5 else int(lo + (hi - lo) * rng.random() ** 0.5)
        out.append(([rng.randrange(3, 500) for _ in range(rng.randint(32, 128))], m))
    return out


def grpo_shaped(groups: int, lo: int, hi: int, seed: int) -> list[tuple[list[int], int]]:
    """``groups`` prompts of ``lo``–``hi`` ids, each sent ``GROUP_SIZE`` times (completions 16–48)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(groups):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))]
        reqs += [(prompt, rng.randint(16, 48)) for _ in range(GROUP_SIZE)]
    return reqs


async def send_all(sampler, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
    """All requests at once; (wall seconds, generated tokens)."""

    async def one(prompt, m):
        (c,) = await sampler.sample_with_prompt_tokens(prompt, max_tokens=m, temperature=1.0, ignore_eos=True)
        if len(c.output_tokens) != m:
            raise RuntimeError(f"asked for {m} tokens, got {len(c.output_tokens)}")
        return m

    t0 = time.perf_counter()
    done = await asyncio.gather(*[one(p, m) for p, m in reqs])
    return time.perf_counter() - t0, sum(done)


async def prompt_tokens_computed(http: aiohttp.ClientSession, name: str, url: str) -> float:
    """Cumulative prompt tokens the server computed (not reused) so far."""
    if name.startswith("embedded"):
        async with http.get(url + "/stats") as r:
            return float((await r.json())["prefill_tokens"])
    async with http.get(url + "/metrics") as r:
        text = await r.text()

    def total(metric: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{metric}_total\{{[^}}]*\}} (\S+)$", text, re.M))

    return total("prefix_cache_queries") - total("prefix_cache_hits")


def generate_tps(model, reqs: list[tuple[list[int], int]]) -> float:
    """Generated tok/s of ``generate`` on one static left-padded batch of ``reqs``."""
    width = max(len(p) for p, _ in reqs)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in reqs])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in reqs])
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(m for _, m in reqs),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            eos_token_id=None,
            pad_token_id=0,
        )
    return sum(m for _, m in reqs) / (time.perf_counter() - t0)


def spread(xs: list[float]) -> str:
    return f"{sig(min(xs), 3)}–{sig(max(xs), 3)}"


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--clients", default="32,64", help="client counts of (a), a row each")
    p.add_argument("--completions", default="64,256", help="completion length range of (a)")
    p.add_argument("--groups", type=int, default=4, help="prompts of (b), each sent 8 times")
    p.add_argument("--group-prompts", default="256,1024", help="prompt length range of (b)")
    p.add_argument("--vllm", choices=["auto", "yes", "no"], default="auto")
    a = p.parse_args()
    started = time.perf_counter()
    if a.quick:
        a.model, a.clients, a.completions, a.groups, a.group_prompts, a.vllm = "tiny", "4", "4,8", 1, "32,64", "no"
    from benchmarks.engine_throughput import vllm_available
    from training.deployment.backends.registry import make_deployment
    from training.deployment.client import DeploymentSampler
    from training.utils import DeployConfig, EngineConfig

    path = model_path(a.model)
    lo, hi = (int(x) for x in a.completions.split(","))
    client_counts = [int(x) for x in a.clients.split(",")]
    plo, phi = (int(x) for x in a.group_prompts.split(","))
    with_vllm = a.vllm == "yes" or (a.vllm == "auto" and vllm_available())
    batch = max(*client_counts, a.groups * GROUP_SIZE)
    max_len = max(128 + hi, phi + 48) + 8
    specs = {"embedded": dict(), "embedded, no prefix caching": dict(enable_prefix_caching=False)}
    deps = {
        name: make_deployment(
            path,
            DeployConfig(
                startup_timeout_s=900, engine_config=EngineConfig(max_batch_size=batch, max_model_len=max_len, **kw)
            ),
        )
        for name, kw in specs.items()
    }
    if with_vllm:
        deps["vLLM"] = make_deployment(
            path,
            DeployConfig(
                engine="vllm",
                startup_timeout_s=900,
                engine_env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                engine_config=EngineConfig(max_batch_size=batch, max_model_len=max_len),
            ),
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tps = {(n, c): [] for n in ["embedded", "vLLM", "generate"] if n in deps or n == "generate" for c in client_counts}
    wall = {n: [] for n in deps}
    computed = {n: [] for n in deps}
    prompt_tokens = []
    try:
        for d in deps.values():
            d.start()

        async def run() -> None:
            samplers = {n: DeploymentSampler(d.base_url, timeout_s=3600) for n, d in deps.items()}
            async with aiohttp.ClientSession() as http:
                try:
                    for s in samplers.values():  # warm-up
                        await send_all(s, decode_heavy(2, 4, 8, seed=999))
                    generate_tps(model, decode_heavy(2, 4, 8, seed=999))
                    for r in range(a.repeats):
                        b_reqs = grpo_shaped(a.groups, plo, phi, seed=200 + r)
                        prompt_tokens.append(sum(len(p_) for p_, _ in b_reqs))
                        order = ["embedded", "vLLM", "generate"]
                        for c in client_counts:
                            a_reqs = decode_heavy(c, lo, hi, seed=100 + r)
                            for n in order[r % 3 :] + order[: r % 3]:
                                wait_for_quiet_cpu()  # the previous side may still be winding down
                                if n == "generate":
                                    tps[n, c].append(generate_tps(model, a_reqs))
                                elif n in samplers:
                                    s_, g = await send_all(samplers[n], a_reqs)
                                    tps[n, c].append(g / s_)
                        names = list(deps)
                        for n in names[r % len(names) :] + names[: r % len(names)]:
                            wait_for_quiet_cpu()
                            before = await prompt_tokens_computed(http, n, deps[n].base_url)
                            s_, _ = await send_all(samplers[n], b_reqs)
                            wall[n].append(s_)
                            computed[n].append(await prompt_tokens_computed(http, n, deps[n].base_url) - before)
                finally:
                    for s in samplers.values():
                        await s.close()

        asyncio.run(run())
    finally:
        for d in deps.values():
            d.stop()
    rows = []
    for c in client_counts:
        la = f"(a) decode-heavy, {a.model}: {c} clients, completions {lo}–{hi}"
        ours_tps = tps["embedded", c]
        for base, label in (("vLLM", "vLLM CPU build, same requests"), ("generate", "generate, one static batch")):
            if (base, c) in tps:
                rows.append(
                    row(
                        la,
                        median(ours_tps),
                        "generated tok/s",
                        label,
                        median(tps[base, c]),
                        spread=spread(ours_tps),
                        baseline_spread=spread(tps[base, c]),
                    )
                )
    lb = f"(b) GRPO-shaped, {a.model}: {a.groups} prompts × {GROUP_SIZE}, prompts {plo}–{phi}"
    # time figures as speed-ups: baseline seconds / our seconds (ratio > 1 = we are faster)
    ours = median(wall["embedded"])
    for base in [n for n in deps if n != "embedded"]:
        rows.append(
            row(
                lb + " (speed-up: baseline s / ours s)",
                1.0 / ours,
                "1/s",
                base,
                1.0 / median(wall[base]),
                seconds=sig(ours),
                baseline_seconds=sig(median(wall[base])),
                spread_s=spread(wall["embedded"]),
                baseline_spread_s=spread(wall[base]),
            )
        )
    frac = {n: sig(median(computed[n]) / median(prompt_tokens), 3) for n in deps}
    rows.append(
        row(
            lb + ": prompt tokens computed / sent",
            frac["embedded"],
            "fraction (lower is better)",
            "same server without prefix caching",
            frac["embedded, no prefix caching"],
            vllm_fraction=frac.get("vLLM"),
        )
    )
    notes = (
        f"Interleaved: all servers up at once, each repeat rotates their order, fresh prompts per repeat. "
        f"vLLM: {'measured' if with_vllm else 'not measured (no venv)'}. Noise: the "
        f"spreads (min–max over {a.repeats} repeats)."
    )
    per_repeat = {  # in repeat order (the spreads are wide: this shows what moved with what)
        **{f"(a) {c} clients tok/s, {n}": [sig(x) for x in tps[n, c]] for n, c in tps},
        **{f"(b) seconds, {n}": [sig(x) for x in wall[n]] for n in wall},
        "(b) prompt tokens sent": prompt_tokens,
    }
    emit(
        "engine_rl_shapes",
        rows,
        headline=0,
        notes=notes,
        started=started,
        repeats=a.repeats,
        extra={"per_repeat": per_repeat},
    )


if __name__ == "__main__":
    main()
