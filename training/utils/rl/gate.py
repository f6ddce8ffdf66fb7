"""The off-policy gate: which rollouts may be submitted, and which may be trained.

Versions count optimizer steps: the trainer's weights after ``k`` steps are version ``k``, and
the step that starts from them is "step ``k``". Every rollout is stamped with
``submit_version``, the version the deployment served when the rollout was submitted.

Rule (per sample, never relaxed): a sample may be trained in the step that starts from
version ``v`` only if ``v - submit_version <= max_offpolicy_versions`` (``O``). A sample that
arrives too late is dropped and counted (``offpolicy/dropped_stale``).

Throttle (so that the rule costs no work in normal running): while the deployment serves
version ``d`` and the trainer is assembling the batch of step ``v``, the producer may start
another group only if the groups already accepted or in flight fit in the steps that can
still use work submitted now, ``v .. d + O``:

    accepted + in_flight < (d + O + 1 - v) * groups_per_step

With ``O = 0`` this serialises at batch boundaries (strict on-policy); with ``O > 0``
rollouts for later steps run while the trainer works on the current one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OffPolicyGate:
    """Admission (``can_submit``) and freshness (``is_fresh``) for one run."""

    max_offpolicy_versions: int
    """``O``: how many versions a sample may lag the weights it is trained from."""
    groups_per_step: int
    """Prompt groups one training step consumes."""
    dropped_stale: int = 0
    """Samples dropped so far because they exceeded the bound."""
    staleness_log: list[int] = field(default_factory=list)
    """Staleness (``v - submit_version``) of every sample admitted to the current step."""
    _dropped_reported: int = 0

    def __post_init__(self):
        if self.max_offpolicy_versions < 0:
            raise ValueError(f"max_offpolicy_versions: must be >= 0, got {self.max_offpolicy_versions}")
        if self.groups_per_step < 1:
            raise ValueError(f"groups_per_step: must be >= 1, got {self.groups_per_step}")

    def submit_capacity(self, deployed_version: int, trainer_version: int) -> int:
        """Groups that may be accepted or in flight at once right now."""
        usable_steps = deployed_version + self.max_offpolicy_versions + 1 - trainer_version
        return max(0, usable_steps) * self.groups_per_step

    def can_submit(self, deployed_version: int, trainer_version: int, outstanding_groups: int) -> bool:
        """True if one more group may be submitted (``outstanding`` = accepted + in flight)."""
        return outstanding_groups < self.submit_capacity(deployed_version, trainer_version)

    def is_fresh(self, submit_version: int, trainer_version: int) -> bool:
        """True if a sample submitted under ``submit_version`` may train in step ``trainer_version``."""
        return trainer_version - submit_version <= self.max_offpolicy_versions

    def admit(self, submit_version: int, trainer_version: int, num_samples: int) -> bool:
        """Check one group for step ``trainer_version``; count and refuse it if stale."""
        if not self.is_fresh(submit_version, trainer_version):
            self.dropped_stale += num_samples
            return False
        self.staleness_log.extend([trainer_version - submit_version] * num_samples)
        return True

    def step_metrics(self) -> dict[str, float]:
        """Staleness of the step just assembled (mean, max, histogram), then reset for the next."""
        s = self.staleness_log or [0]
        metrics: dict[str, float] = {
            "offpolicy/staleness_mean": sum(s) / len(s),
            "offpolicy/staleness_max": float(max(s)),
            "offpolicy/dropped_stale": float(self.dropped_stale - self._dropped_reported),
            "offpolicy/dropped_stale_total": float(self.dropped_stale),
        }
        self._dropped_reported = self.dropped_stale
        for k in range(self.max_offpolicy_versions + 1):
            metrics[f"offpolicy/staleness_hist_{k}"] = float(sum(1 for x in s if x == k))
        self.staleness_log = []
        return metrics
