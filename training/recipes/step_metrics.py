"""What a step reports besides the training itself: ``StepCounters`` (the rollout outcomes since the last
step: ``rollout/*``, ``agent/*``, ``rollout/failed/<cause>``), ``StepTimer`` (``perf/*``: the step's
seconds in total and per phase, token rates), ``batch_metrics`` (``rollout/*`` of the groups a step
trains on) and ``server_metrics`` (``perf/server_*``: the embedded servers' resident memory and KV
blocks, from their ``GET /stats``). Both recipes use all four.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

from training.utils.rl.groups import PromptGroup
from training.utils.rl.reward_components import component_metrics
from training.utils.rl.run_metrics import run_metrics


class StepCounters:
    """Rollout outcomes since the last step (what ``rollout/*`` reports), plus the agent runs'
    ``agent/*`` and ``rollout/failed/<cause>`` metrics (``training/utils/rl/run_metrics.py``)."""

    def __init__(self):
        self.attempts = self.failures = self.errors = self.timeouts = self.invalid = self.dropped = 0
        self.groups_done = self.filtered_groups = self.small_groups = self.requeued_groups = 0
        self.overlong_filtered = 0
        self.generated_tokens = 0
        self.run_metadata: list[dict] = []
        self.failure_causes: dict[str, int] = {}

    def add(self, g: PromptGroup) -> None:
        self.attempts += g.attempts
        self.failures += g.failures
        self.errors += g.errors
        self.timeouts += g.timeouts
        self.invalid += g.invalid
        self.dropped += g.dropped
        self.overlong_filtered += g.overlong_filtered
        self.groups_done += 1
        self.generated_tokens += sum(s.num_trainable_tokens for s in g.samples)
        self.run_metadata.extend(g.metadata.values())
        for cause, n in g.failure_causes.items():
            self.failure_causes[cause] = self.failure_causes.get(cause, 0) + n

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/attempts": float(self.attempts),
            "rollout/errors": float(self.errors),
            "rollout/timeouts": float(self.timeouts),
            "rollout/invalid": float(self.invalid),
            "rollout/returned_none": float(self.dropped),
            "rollout/overlong_filtered": float(self.overlong_filtered),
            "rollout/filtered_groups": float(self.filtered_groups),
            "rollout/too_small_groups": float(self.small_groups),
            "rollout/requeued_groups": float(self.requeued_groups),
            "rollout/generated_tokens": float(self.generated_tokens),
            **run_metrics(self.run_metadata, self.failure_causes),
        }


class StepTimer:
    """Seconds of one step, in total and per phase: ``perf/step_time_s`` and ``perf/<phase>_s``."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    def metrics(self, m: dict[str, float]) -> dict[str, float]:
        """The ``perf/*`` metrics of the step, with token rates from ``m`` (the step's other metrics)."""
        total = time.perf_counter() - self.t0
        out = {"perf/step_time_s": total, **{f"perf/{k}_s": v for k, v in self.seconds.items()}}
        out["perf/generated_tokens_per_s"] = m.get("rollout/generated_tokens", 0.0) / max(total, 1e-9)
        out["perf/trained_tokens_per_s"] = m.get("train/tokens", 0.0) / max(self.seconds.get("train", 0.0), 1e-9)
        return out


def batch_metrics(groups: list[PromptGroup]) -> dict[str, float]:
    """``rollout/*`` metrics of the groups a step trains on; ``rollout/reward/<name>_mean`` per reward component
    (``training/utils/rl/reward_components.py``)."""
    rewards = [r for g in groups for r in g.rewards]
    lengths = [s.num_trainable_tokens for g in groups for s in g.samples]
    n = max(len(rewards), 1)
    mean = sum(rewards) / n
    return {
        "rollout/reward_mean": mean,
        "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "rollout/groups": float(len(groups)),
        "rollout/samples": float(sum(len(g.samples) for g in groups)),
        "rollout/completion_tokens_mean": sum(lengths) / max(len(lengths), 1),
        "rollout/truncated_fraction": sum(1.0 for g in groups for s in g.samples if s.finish_reason == "length")
        / max(len(lengths), 1),
        **component_metrics(groups),
    }


def server_metrics(stats: list[Optional[dict]]) -> dict[str, float]:
    """``perf/server_rss_mb`` (the largest resident memory among the replicas), ``perf/kv_blocks_used`` (held by
    running sequences) and ``perf/kv_blocks_cached`` (reusable prefixes), summed over the replicas, from each
    replica's ``GET /stats``; empty when none reports them (vLLM, SGLang)."""
    known = [s for s in stats if s]
    rss = [s.get("pools", {}).get("rss_bytes", {}).get("size") for s in known]
    kv = [s["kv_cache"] for s in known if isinstance(s.get("kv_cache"), dict)]
    out: dict[str, float] = {}
    if any(r is not None for r in rss):
        out["perf/server_rss_mb"] = max(r for r in rss if r is not None) / 2**20
    if kv:
        out["perf/kv_blocks_used"] = float(sum(k.get("blocks_used", 0) for k in kv))
        out["perf/kv_blocks_cached"] = float(sum(k.get("blocks_cached", 0) for k in kv))
    return out
