"""Run every benchmark script and rewrite BENCHMARKS.md from their JSON lines.

    python -m benchmarks.run_all [--only async_overlap,exactness] [--quick] [--from-json benchmarks/results.json]
    python -m benchmarks.run_all --only end_to_end             # the opt-in end-to-end figure, others kept
    python -m benchmarks.run_all --only distillation           # distillation vs RL (the teacher must exist)
    python -m benchmarks.run_all --add line.json               # a figure run by hand, others kept

Each script runs in its own process (``python -m benchmarks.<name>``), one after the other, so they
never share the cores; its last stdout line is its JSON figure. The raw lines are saved to
``benchmarks/results.json``; ``--from-json`` rebuilds BENCHMARKS.md from such a file without
running anything. With ``--only`` the other figures of the saved file are kept (one figure can be
re-measured without regenerating the rest). ``end_to_end`` (against TRL and TRL + vLLM, about 15 minutes per
seed on an idle machine, 2 more per ``--variant``) and
``distillation`` (distillation vs RL, about 40 minutes, after the arithmetic example exported the teacher) run only
when named in ``--only``; ``--add`` puts a JSON line printed by a script run by hand (e.g. with other
``--steps``) into the saved results the same way. A kept figure is shown with its own date; the whole
default run keeps the saved opt-in figures.
Benchmarks are not tests: CI never runs them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import render

SCRIPTS = [
    "async_overlap",
    "async_agentic",
    "engine_throughput",
    "engine_rl_shapes",
    "decode_roofline",
    "trainer_throughput",
    "weight_sync",
    "exactness",
    "sampling_cost",
]
OPT_IN = ["end_to_end", "distillation"]
"""Scripts too long for the default run: they run only when ``--only`` names them."""
TIMEOUT_S = {
    "end_to_end": 6 * 3600.0,
    "distillation": 3 * 3600.0,
    "engine_throughput": 3600.0,
    "engine_rl_shapes": 3600.0,
    "async_agentic": 3600.0,
}
"""Per-script timeouts that replace ``--timeout``."""
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"


def merge_results(old: dict, new: dict) -> dict:
    """``old`` with the figures of ``new`` replaced or added (in ``SCRIPTS`` order); dates of both kept."""
    by_name = {r["figure"]: r for r in old["results"]}
    for r in new["results"]:
        r["date"] = new["date"]
        by_name[r["figure"]] = r
    order = {n: i for i, n in enumerate(SCRIPTS)}
    results = sorted(by_name.values(), key=lambda r: order.get(r["figure"], len(order)))
    return {**old, "results": results, "updated": new["date"]}


def with_saved(old: dict, new: dict, whole_run: bool) -> dict:
    """What to save after a run: a partial run (``--only``) merged into ``old``; the whole default run as it is
    plus ``old``'s opt-in figures (it does not run them), each with its own date."""
    if not whole_run:
        return merge_results(old, new)
    kept = [{"date": old["date"], **r} for r in old["results"] if r["figure"] in OPT_IN]
    return {**new, "results": new["results"] + kept}


def run_script(name: str, quick: bool, timeout_s: float) -> dict:
    """Run one script; its JSON line, or ``{"figure", "error"}`` when it failed."""
    cmd = [sys.executable, "-m", f"benchmarks.{name}"] + (["--quick"] if quick else [])
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"figure": name, "error": f"timed out after {timeout_s:.0f} s"}
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"figure": name, "error": f"exit {out.returncode}: {out.stderr[-1500:]}"}
    result = json.loads(lines[-1])
    result.setdefault("date", _now())
    print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return result


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only",
        default=",".join(SCRIPTS),
        help="comma-separated subset of " + ",".join(SCRIPTS + OPT_IN) + f" ({','.join(OPT_IN)} only when named)",
    )
    p.add_argument("--add", help="a file with a script's JSON line: merge it into the saved results, run nothing")
    p.add_argument("--quick", action="store_true", help="pass --quick to every script (a smoke run, not figures)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per script")
    p.add_argument("--from-json", help="rebuild BENCHMARKS.md from a saved results file, run nothing")
    p.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    a = p.parse_args()
    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
    elif a.add:
        lines = [l for l in Path(a.add).read_text().splitlines() if l.startswith("{")]
        if not lines:
            raise SystemExit(f"--add: no JSON line in {a.add}")
        saved = merge_results(json.loads(RESULTS.read_text()), {"date": _now(), "results": [json.loads(lines[-1])]})
        RESULTS.write_text(json.dumps(saved, indent=1) + "\n")
    else:
        names = [n for n in a.only.split(",") if n]
        unknown = sorted(set(names) - set(SCRIPTS) - set(OPT_IN))
        if unknown:
            raise SystemExit(f"--only: unknown script(s) {unknown}; choose from {SCRIPTS + OPT_IN}")
        t0 = time.perf_counter()
        now = _now()
        results = [{**run_script(n, a.quick, TIMEOUT_S.get(n, a.timeout)), "date": now} for n in names]
        saved = {
            "date": now,
            "command": "python -m benchmarks.run_all" + (" --quick" if a.quick else ""),
            "total_s": round(time.perf_counter() - t0),
            "results": results,
        }
        if RESULTS.exists():
            saved = with_saved(json.loads(RESULTS.read_text()), saved, whole_run=a.only == p.get_default("only"))
        RESULTS.write_text(json.dumps(saved, indent=1) + "\n")
    Path(a.out).write_text(render(saved))
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
