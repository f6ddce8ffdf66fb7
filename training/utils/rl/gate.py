"""The off-policy gate: which rollouts may be submitted, in which step each is trained, and when the
trainer must wait.

Versions count optimizer steps: the trainer's weights after ``k`` steps are version ``k``, and
the step that starts from them is "step ``k``". Every group is stamped with ``submit_version``
``s``, the version the deployment served when it was submitted, and gets the deadline
``s + O`` (``O`` = ``max_offpolicy_versions``): the last step allowed to train it. ``B`` =
``groups_per_step``; ``N_v(<= k)`` = groups not yet consumed (running or finished) whose
deadline is at most ``k`` while the batch of step ``v`` is assembled.

**Bound** (per sample, never relaxed): a sample trained in step ``v`` has ``v - s <= O``.
With in-flight weight updates a sample's tokens come from versions ``>= s`` (each token's lag
``v - version <= v - s``), so the bound holds per token too.

**How ``stale_policy="wait"`` meets it without discarding**: the invariant

    C(k):  N_v(<= k) <= (k - v + 1) * B      for every k >= v

(everything due by step ``k`` fits in the steps ``v .. k`` that are left) is kept by both moves:

- *admission* (``can_submit``): a new group under deployed version ``d`` has the latest deadline
  ``d + O``, so only ``C(d + O)`` can break: submit while
  ``outstanding < (d + O + 1 - v) * B``. A group that could not meet its deadline is never let in.
- *consumption* (``plan_batch``): step ``v`` takes the finished groups oldest-submitted first, and
  must take at least ``r_k = N_v(<= k) - (k - v) * B`` groups due by ``k`` for each ``k``, so that
  ``C(k)`` holds for step ``v + 1``. ``C(v)`` gives ``r_v = N_v(<= v) <= B``: every group due now
  fits in this batch. When the oldest finished groups do not meet some ``r_k`` (an older group is
  still running) the trainer waits for it (``offpolicy/trainer_wait_s``).

**Bypass window**: the batch of step ``v`` has ``W_v = max(0, B - max(0, max_k r_k))`` slots that
younger finished groups may take while older ones still run (``offpolicy/bypass_window``; 0
whenever the admission window is full, the steady state of a busy run, since then the deadlines
claim every slot; under ``drop`` more than ``B`` may be due, still 0 slots); the other
slots belong to the groups the deadlines need. Oldest-first order within the window means a
finished group is never passed over for a younger one. Filtered and failed groups only lower
``N``; nothing in the proof assumes a group finishes in time, only that the trainer waits for it.

``stale_policy="drop"`` (the older behaviour, kept as a choice): never wait; a finished group
past its deadline is dropped and counted (``offpolicy/dropped_stale``), and the recipe requeues
its row (it is trained later under newer weights, never lost).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

STALE_POLICIES = ("wait", "drop")


@dataclass
class OffPolicyGate:
    """Admission (``can_submit``), batch planning (``plan_batch``) and staleness metrics for one run."""

    max_offpolicy_versions: int
    """``O``: how many versions a sample may lag the weights it is trained from."""
    groups_per_step: int
    """``B``: prompt groups one training step consumes."""
    stale_policy: str = "wait"
    """``wait``: the trainer waits for the oldest groups (nothing dropped); ``drop``: late groups are dropped."""
    dropped_stale: int = 0
    """Samples dropped so far because they exceeded the bound."""
    dropped_stale_groups: int = 0
    """Groups dropped so far because they exceeded the bound."""
    staleness_log: list[int] = field(default_factory=list)
    """Staleness (``v - submit_version``) of every sample admitted to the current step."""
    token_lag_log: list[int] = field(default_factory=list)
    """Lag (``v - token version``) of every trainable token with a recorded version in the current step."""
    _dropped_reported: int = 0
    _dropped_groups_reported: int = 0

    def __post_init__(self):
        if self.max_offpolicy_versions < 0:
            raise ValueError(f"max_offpolicy_versions: must be >= 0, got {self.max_offpolicy_versions}")
        if self.groups_per_step < 1:
            raise ValueError(f"groups_per_step: must be >= 1, got {self.groups_per_step}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy: {self.stale_policy!r} is not one of {STALE_POLICIES}")

    # ---- admission ---------------------------------------------------------------------
    def submit_capacity(self, deployed_version: int, trainer_version: int) -> int:
        """Groups that may be accepted or in flight at once right now: ``(d + O + 1 - v) * B``."""
        usable_steps = deployed_version + self.max_offpolicy_versions + 1 - trainer_version
        return max(0, usable_steps) * self.groups_per_step

    def can_submit(self, deployed_version: int, trainer_version: int, outstanding_groups: int) -> bool:
        """True if one more group may be submitted (``outstanding`` = accepted + in flight)."""
        return outstanding_groups < self.submit_capacity(deployed_version, trainer_version)

    # ---- consumption -------------------------------------------------------------------
    def deadline(self, submit_version: int) -> int:
        """The last step that may train a group submitted under ``submit_version``."""
        return submit_version + self.max_offpolicy_versions

    def is_fresh(self, submit_version: int, trainer_version: int) -> bool:
        """True if a sample submitted under ``submit_version`` may train in step ``trainer_version``."""
        return trainer_version <= self.deadline(submit_version)

    def required(self, step: int, outstanding_versions: Sequence[int]) -> dict[int, int]:
        """``r_k`` for each deadline ``k``: groups due by ``k`` that step ``step`` must take (see the module doc)."""
        deadlines = [self.deadline(s) for s in outstanding_versions]
        return {
            k: sum(1 for d in deadlines if d <= k) - (k - step) * self.groups_per_step for k in sorted(set(deadlines))
        }

    def bypass_window(self, step: int, outstanding_versions: Sequence[int]) -> int:
        """``W_v``: batch slots of step ``step`` that younger groups may take while older ones run."""
        r = self.required(step, outstanding_versions).values()
        return max(0, self.groups_per_step - max([0, *r]))  # > B due now (under ``drop``): still no slot

    def plan_batch(
        self,
        step: int,
        ready_versions: Sequence[int],
        running_versions: Sequence[int],
    ) -> Optional[list[int]]:
        """Which finished groups step ``step`` trains now, or None when it must wait.

        ``ready_versions``: submit versions of the finished groups, oldest-submitted first;
        ``running_versions``: those of the groups still in flight. Returns indices into
        ``ready_versions`` (the oldest ``B``, fewer only when nothing runs). Under ``wait`` None
        means an older running group is needed to meet some deadline (or fewer than ``B`` are
        finished); under ``drop`` only the latter. Stale groups must be removed beforehand.
        """
        b = self.groups_per_step
        if len(ready_versions) < b and running_versions:
            return None
        take = list(range(min(b, len(ready_versions))))
        if self.stale_policy == "drop" or not running_versions:
            return take  # nothing left to wait for
        taken = [self.deadline(ready_versions[i]) for i in take]
        for k, r_k in self.required(step, [*ready_versions, *running_versions]).items():
            if sum(1 for d in taken if d <= k) < r_k:
                return None
        return take

    def admit(self, submit_version: int, trainer_version: int, num_samples: int) -> bool:
        """Check one group for step ``trainer_version``; count and refuse it if stale."""
        if not self.is_fresh(submit_version, trainer_version):
            self.dropped_stale += num_samples
            self.dropped_stale_groups += 1
            return False
        self.staleness_log.extend([trainer_version - submit_version] * num_samples)
        return True

    def record_token_versions(self, trainer_version: int, token_versions: Optional[Sequence[int]]) -> None:
        """Log the lag of each trainable token of one sample (no-op when its versions are unknown)."""
        if token_versions:
            self.token_lag_log.extend(trainer_version - v for v in token_versions)

    def step_metrics(self) -> dict[str, float]:
        """Staleness and token lag of the step just assembled (mean, max, histogram), then reset."""
        s = self.staleness_log or [0]
        metrics: dict[str, float] = {
            "offpolicy/staleness_mean": sum(s) / len(s),
            "offpolicy/staleness_max": float(max(s)),
            "offpolicy/dropped_stale": float(self.dropped_stale - self._dropped_reported),
            "offpolicy/dropped_stale_total": float(self.dropped_stale),
            "offpolicy/dropped_stale_groups": float(self.dropped_stale_groups - self._dropped_groups_reported),
        }
        self._dropped_reported = self.dropped_stale
        self._dropped_groups_reported = self.dropped_stale_groups
        for k in range(self.max_offpolicy_versions + 1):
            metrics[f"offpolicy/staleness_hist_{k}"] = float(sum(1 for x in s if x == k))
        lags = self.token_lag_log
        if lags:
            metrics["offpolicy/token_lag_mean"] = sum(lags) / len(lags)
            metrics["offpolicy/token_lag_max"] = float(max(lags))
            for k in range(max(self.max_offpolicy_versions, max(lags)) + 1):
                metrics[f"offpolicy/token_lag_hist_{k}"] = float(sum(1 for x in lags if x == k))
        self.staleness_log = []
        self.token_lag_log = []
        return metrics
