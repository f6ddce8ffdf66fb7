"""Weight sync: from "the trainer has new weights" to "the server generates with them".

    python -m benchmarks.weight_sync [--models tiny,smollm2] [--quick]

For each model an ``EmbeddedDeployment`` (fp32, CPU) serves; the trainer side is a
``PolicyTrainer`` whose weights are perturbed before every update (so each update is new).
Timed per update, median of ``--repeats``: ``named_weights()`` in hand → ``push_weights`` (shm:
safetensors in /dev/shm + ``/update_weights_from_shm``; disk: a safetensors folder +
``/update_weights_from_disk``) → one 1-token completion that reports the new ``weight_version``.
Baseline: what a naive loop does, ``save_pretrained`` to disk, stop the server, start a new one
on that folder, wait for health, one completion.
Memory: the server's peak RSS growth during an update (``/proc/PID/clear_refs`` resets VmHWM,
then VmHWM after − VmRSS before), as a multiple of the weights' size in bytes.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import base_parser, emit, median, model_path, row


def proc_kb(pid: int, field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of a process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/{pid}/status")


def reset_peak(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux: write 5 to clear_refs); False if not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


async def _generate_once(base_url: str, prompt: list[int]) -> int:
    from training.deployment.client import DeploymentSampler

    sampler = DeploymentSampler(base_url)
    try:
        (c,) = await sampler.sample_with_prompt_tokens(prompt, max_tokens=1, temperature=1.0)
        return c.weight_version
    finally:
        await sampler.close()


def perturb(trainer) -> None:
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-4)


def bench_model(name: str, repeats: int) -> list[dict]:
    from training.deployment.backends.embedded import EmbeddedDeployment
    from training.trainer import PolicyTrainer
    from training.utils import DeployConfig, EngineConfig, TrainerConfig

    path = model_path(name)
    trainer = PolicyTrainer(path, TrainerConfig(device="cpu"))
    weight_bytes = sum(t.numel() * t.element_size() for _, t in trainer.named_weights())
    prompt = [5, 17, 42, 7]
    cfg = DeployConfig(engine_config=EngineConfig(max_batch_size=8, max_model_len=256))
    times = {"shm": [], "disk": []}
    mem = {"shm": [], "disk": []}
    version = 0
    tmp = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    try:
        with EmbeddedDeployment(path, cfg) as dep:
            asyncio.run(_generate_once(dep.base_url, prompt))  # warm-up
            for mode in ("shm", "disk"):
                for i in range(repeats + 1):  # update 0 is a warm-up
                    perturb(trainer)
                    version += 1
                    rss0 = proc_kb(dep.pid, "VmRSS")
                    can_reset = reset_peak(dep.pid)

                    async def update(version=version, mode=mode) -> int:
                        named = list(trainer.named_weights())
                        await dep.push_weights(named, version, mode=mode, directory=str(tmp / f"v{version}"))
                        return await _generate_once(dep.base_url, prompt)

                    t0 = time.perf_counter()
                    got = asyncio.run(update())
                    dt = time.perf_counter() - t0
                    if got != version:
                        raise RuntimeError(f"{mode}: server answered with weight_version {got}, expected {version}")
                    if i > 0:
                        times[mode].append(dt)
                        if can_reset:
                            mem[mode].append((proc_kb(dep.pid, "VmHWM") - rss0) * 1024 / weight_bytes)
                    shutil.rmtree(tmp / f"v{version}", ignore_errors=True)
        restart = []
        for i in range(repeats):
            perturb(trainer)
            t0 = time.perf_counter()
            folder = trainer.save_pretrained(tmp / f"restart{i}")
            with EmbeddedDeployment(str(folder), cfg) as dep:
                asyncio.run(_generate_once(dep.base_url, prompt))
            restart.append(time.perf_counter() - t0)
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mb = weight_bytes / 1e6
    rows = []
    for mode in ("shm", "disk"):
        rows.append(
            row(
                f"{name} ({mb:.1f} MB fp32): update via {mode}",
                median(times[mode]),
                "s (lower is better)",
                "restart the server from disk",
                median(restart),
            )
        )
    for mode in ("shm", "disk"):
        if mem[mode]:
            rows.append(
                {
                    "name": f"{name}: server peak extra RSS during a {mode} update",
                    "unit": "× weight size",
                    "value": round(median(mem[mode]), 3),
                    "baseline": "weight size",
                    "baseline_value": 1.0,
                    "ratio": round(median(mem[mode]), 3),
                }
            )
    return rows


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--models", default="tiny,smollm2")
    a = p.parse_args()
    started = time.perf_counter()
    rows = []
    for name in ["tiny"] if a.quick else a.models.split(","):
        rows += bench_model(name, a.repeats)
    emit(
        "weight_sync",
        rows,
        notes="Ratios are time / restart time: below 1 is faster than restarting.",
        started=started,
        repeats=a.repeats,
    )


if __name__ == "__main__":
    main()
