"""Soak: does the server's memory level off under a long load, or grow without end?

    python -m benchmarks.soak [--minutes 30] [--clients 128] [--sample-s 5] [--out benchmarks/soak] [--note TEXT]

Starts the embedded server (tiny model, CPU, fp32) at the server's default settings (``SOAK_ENGINE``:
``EngineConfig`` with only the device pinned to the CPU) and runs ``--clients`` concurrent clients for
``--minutes``: each sends, back to back, a mix of token-in completions (random prompts),
chat completions, and calls under a fresh ``x-multi-turn-session-id`` every time (so parked
sessions and cached prefixes keep being made and must be evicted). Every ``--sample-s`` seconds
it reads ``GET /stats`` and records the server process's resident memory, its C heap (bytes in use,
bytes free in the allocator's arenas: a leak or a filling cache grows the first, fragmentation the
second), open descriptors and every engine pool's size. Writes ``<out>.csv`` and ``<out>.png``, prints
the table, and ``plateau()`` judges it: after warm-up (the first third), the last third's maximum of
each series is at most the middle third's maximum × 1.05 plus a small slack (``SLACK``). ``<out>.md`` (the run's
facts and table) is what ``benchmarks/report.py`` puts under BENCHMARKS.md's ``soak`` section.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

API_KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SLACK = {"rss_mb": 16.0, "heap_in_use_mb": 16.0, "open_fds": 8}
"""Absolute allowance on top of ``GROWTH``: allocator noise and sockets mid-reconnect."""
GROWTH = 1.05
COLUMNS = (
    "t_s",
    "rss_mb",
    "heap_in_use_mb",
    "heap_free_mb",
    "open_fds",
    "open_sockets",
    "parked_sessions",
    "kv_cache_blocks",
    "waiting",
    "requests",
)
JUDGED = ("rss_mb", "heap_in_use_mb", "open_fds", "parked_sessions", "kv_cache_blocks")
"""The series that must level off."""
SOAK_ENGINE = {"device": "cpu"}
"""The only engine settings the soak pins; every other one is ``EngineConfig``'s default (what a user gets)."""


@dataclass
class SoakResult:
    rows: list[dict] = field(default_factory=list)
    """One row per sample, keyed by ``COLUMNS``."""
    errors: int = 0
    """Requests that failed (any status other than 200, or a connection error)."""
    bounds: dict = field(default_factory=dict)
    """Each pool's bound as the server reported it."""
    kernel_caches: dict = field(default_factory=dict)
    """The capacity of each of oneDNN's per-shape caches as the server reported it (``kernel_caches.py``)."""


def _mb(n) -> float:
    return -1.0 if n is None else round(n / 2**20, 1)  # -1: not reported (no glibc)


def plateau(rows: list[dict], column: str) -> tuple[bool, float, float]:
    """(levelled off, middle third's max, last third's max) of ``column`` over ``rows``."""
    if len(rows) < 6:
        raise ValueError(f"plateau: need at least 6 samples, got {len(rows)}")
    third = len(rows) // 3
    middle = max(r[column] for r in rows[third : 2 * third])
    last = max(r[column] for r in rows[2 * third :])
    return last <= middle * GROWTH + SLACK.get(column, 0.0), middle, last


async def _client(session: aiohttp.ClientSession, url: str, k: int, stop: float, counts: dict) -> None:
    rng = random.Random(k)
    while time.monotonic() < stop:
        kind = rng.randrange(3)
        headers = dict(AUTH)
        if kind == 0:
            path = "/v1/completions"
            body = {"prompt": [rng.randrange(10, 250) for _ in range(rng.randrange(4, 40))], "max_tokens": 4}
        else:
            path = "/v1/chat/completions"
            words = " ".join(rng.choice(["a", "b", "soak", "memory", "test"]) for _ in range(rng.randrange(2, 12)))
            body = {"messages": [{"role": "user", "content": words}], "max_tokens": 4}
            if kind == 2:
                headers["x-multi-turn-session-id"] = f"soak-{k}-{counts['requests']}"
        body.update(model="tiny", temperature=1.0, ignore_eos=True)
        try:
            async with session.post(url + path, json=body, headers=headers) as r:
                await r.read()
                counts["errors"] += r.status != 200
        except aiohttp.ClientError:
            counts["errors"] += 1
        counts["requests"] += 1


async def _sample(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/stats", headers=AUTH) as r:
        return await r.json()


async def soak(url: str, minutes: float, clients: int, sample_s: float) -> SoakResult:
    """Load ``url`` with ``clients`` clients for ``minutes``; sample ``/stats`` every ``sample_s`` seconds."""
    result = SoakResult()
    counts = {"requests": 0, "errors": 0}
    t0 = time.monotonic()
    stop = t0 + minutes * 60
    conn = aiohttp.TCPConnector(limit=clients + 4)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [asyncio.create_task(_client(session, url, k, stop, counts)) for k in range(clients)]
        while time.monotonic() < stop:
            await asyncio.sleep(sample_s)
            stats = await _sample(session, url)
            pools = stats["pools"]
            result.bounds = {name: p["bound"] for name, p in pools.items()}
            result.kernel_caches = stats.get("kernel_caches", {})
            result.rows.append(
                {
                    "t_s": round(time.monotonic() - t0, 1),
                    "rss_mb": _mb(pools["rss_bytes"]["size"]),
                    "heap_in_use_mb": _mb(pools["heap_in_use_bytes"]["size"]),
                    "heap_free_mb": _mb(pools["heap_free_bytes"]["size"]),
                    "open_fds": pools["open_fds"]["size"],
                    "open_sockets": pools["open_sockets"]["size"],
                    "parked_sessions": pools["parked_sessions"]["size"],
                    "kv_cache_blocks": pools["kv_cache_blocks"]["size"],
                    "waiting": pools["waiting"]["size"],
                    "requests": counts["requests"],
                }
            )
        await asyncio.gather(*tasks)
    result.errors = counts["errors"]
    return result


def run_soak(model_path: str, minutes: float, clients: int, sample_s: float, log_dir: Path) -> SoakResult:
    """Start the embedded server on ``model_path`` and soak it (see ``soak``)."""
    from training.deployment.backends.embedded import EmbeddedDeployment
    from training.utils.config import DeployConfig, EngineConfig

    cfg = DeployConfig(
        api_key=API_KEY,
        startup_timeout_s=300,
        log_file=str(log_dir / "server.log"),
        engine_config=EngineConfig(**SOAK_ENGINE),
    )
    with EmbeddedDeployment(model_path, cfg, served_model_name="tiny") as dep:
        return asyncio.run(soak(dep.base_url, minutes, clients, sample_s))


def write_outputs(result: SoakResult, out: Path, title: str) -> None:
    """``out``.csv (every sample) and ``out``.png (memory and descriptors over time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(result.rows)
    t = [r["t_s"] / 60 for r in result.rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6, 4.5), sharex=True)
    ax1.plot(t, [r["rss_mb"] for r in result.rows], label="resident")
    ax1.plot(t, [r["heap_in_use_mb"] for r in result.rows], label="heap in use")
    ax1.plot(t, [r["heap_free_mb"] for r in result.rows], label="heap free")
    ax1.set_ylabel("server MiB")
    ax1.legend(fontsize=7)
    ax1.set_ylim(bottom=0)
    ax2.plot(t, [r["open_fds"] for r in result.rows], label="open fds")
    ax2.plot(t, [r["parked_sessions"] for r in result.rows], label="parked sessions")
    ax2.plot(t, [r["kv_cache_blocks"] for r in result.rows], label="KV cache blocks (used + cached)")
    ax2.set_ylabel("count")
    ax2.set_xlabel("minutes")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=80)
    plt.close(fig)


def table(result: SoakResult) -> str:
    """A markdown table of about 10 evenly spaced samples, and the plateau verdicts."""
    step = max(1, len(result.rows) // 10)
    picked = result.rows[::step]
    if result.rows and picked[-1] is not result.rows[-1]:
        picked.append(result.rows[-1])
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in picked]
    lines.append("")
    for column in JUDGED:
        ok, middle, last = plateau(result.rows, column)
        lines.append(f"- {column}: middle third max {middle}, last third max {last}: {'levels off' if ok else 'GROWS'}")
    lines.append(f"- pool bounds reported by /stats: {json.dumps(result.bounds)}; failed requests: {result.errors}")
    lines.append(f"- kernel cache capacities reported by /stats: {json.dumps(result.kernel_caches)}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=128)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/soak"))
    p.add_argument("--note", default="", help="the machine's state, put in the report's first line")
    args = p.parse_args()
    from training.models.build_tiny import ensure_tiny_model

    with tempfile.TemporaryDirectory() as d:
        result = run_soak(ensure_tiny_model("qwen3"), args.minutes, args.clients, args.sample_s, Path(d))
    write_outputs(result, args.out, f"soak: {args.clients} clients, {args.minutes:g} min, tiny model, CPU")
    head = (
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.clients} clients for {args.minutes:g} "
        f"minutes on {os.cpu_count()} cores{', ' + args.note if args.note else ''}, tiny model, CPU fp32, "
        f"engine settings: defaults except {json.dumps(SOAK_ENGINE)}; {result.rows[-1]['requests']} requests; "
        f"reproduce: `python -m benchmarks.soak --minutes {args.minutes:g} --clients {args.clients}` "
        f"(samples: `{args.out.with_suffix('.csv')}`)."
    )
    report = f"{head}\n\n![soak]({args.out.with_suffix('.png')})\n\n{table(result)}\n"
    args.out.with_suffix(".md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
