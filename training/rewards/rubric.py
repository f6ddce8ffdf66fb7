"""``Rubric``: a reward made of weighted criteria, each checked by a judge call or a Python function.

    from training.rewards import Criterion, GroupJudge, JudgeConfig, Rubric

    judge = GroupJudge(JudgeConfig(model="smollm2"))
    rubric = Rubric(
        [
            Criterion("follows_instructions", 2.0, judge="Does the response do exactly what the task asks?"),
            Criterion("short", 1.0, fn=lambda m: 1.0 if len(m.text) <= 200 else 0.0),
            Criterion("verifier", 1.0, fn=lambda m: m.reward),  # what the rollout_fn returned
        ],
        judge=judge,
    )
    cfg = Config(..., group_reward_fn=rubric)

A member's reward is the weighted sum ``R = sum_c w_c * r_c`` over the criteria. ``r_c`` of a ``judge`` criterion
is the judge's normalised reward for the member when it ranks the whole group on that criterion alone (one request
per criterion and group, run concurrently, the criterion's text as the rubric: ``judge.py``); ``r_c`` of an ``fn``
criterion is ``fn(member)`` (a ``judge.Member``: ``text``, ``reward`` (the rollout's own), ``row``, ``metadata``),
a finite float.

Components as named rewards: every member's metadata gets ``reward_components`` ``{criterion name: r_c}`` (step
metrics ``reward/<name>``: each component's mean) and ``rubric``: per criterion its ``weight`` and ``value``, and
for a judge criterion the judgement (``judge.judgement_record``: the first member holds the prompt and the raw
answer). A judge that fails raises ``JudgeError``; an ``fn`` that raises or returns a non-finite value raises
``GroupRewardError`` (cause ``rubric``): either way the recipe drops the group and counts it.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from training.rewards.judge import (
    GroupJudge,
    Member,
    add_metadata,
    default_member_text,
    group_members,
    judgement_record,
    set_rewards,
)
from training.utils.rl.group_reward import GroupRewardError
from training.utils.rl.groups import PromptGroup


@dataclass(frozen=True)
class Criterion:
    """One weighted check of a rubric: exactly one of ``judge`` (what the judge is asked) and ``fn``."""

    name: str
    """Its reward component's name (``reward/<name>``): letters, digits and ``_``."""
    weight: float = 1.0
    """Its weight in the sum (negative: a penalty)."""
    judge: Optional[str] = None
    """The criterion as the judge's rubric text; the group is ranked on it alone."""
    fn: Optional[Callable[[Member], float]] = None
    """``fn(member) -> float``, checked in Python."""

    def __post_init__(self):
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"Criterion.name: must be letters, digits and _, got {self.name!r}")
        if not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise ValueError(f"Criterion {self.name!r}: weight must be a finite number, got {self.weight!r}")
        if (self.judge is None) == (self.fn is None):
            raise ValueError(f"Criterion {self.name!r}: give exactly one of judge (a text) and fn (a function)")
        if self.judge is not None and not (isinstance(self.judge, str) and self.judge.strip()):
            raise ValueError(f"Criterion {self.name!r}: judge must be the criterion's text, got {self.judge!r}")
        if self.fn is not None and not callable(self.fn):
            raise ValueError(f"Criterion {self.name!r}: fn must be callable, got {self.fn!r}")


class Rubric:
    """A group reward (``Config.group_reward_fn``): the weighted sum of its criteria (module docstring)."""

    def __init__(self, criteria: Sequence[Criterion], judge: Optional[GroupJudge] = None, name: str = "rubric"):
        criteria = list(criteria)
        if not criteria:
            raise ValueError("criteria: give at least one Criterion")
        names = [c.name for c in criteria]
        if len(set(names)) != len(names):
            raise ValueError(f"criteria: names must differ, got {names}")
        if judge is None and any(c.judge is not None for c in criteria):
            raise ValueError("judge: a criterion is checked by the judge, so the Rubric needs judge=GroupJudge(...)")
        self.criteria = criteria
        self.judge = judge
        self.__name__ = name

    def __deepcopy__(self, memo: dict) -> "Rubric":
        return self  # holds a live judge: copies (``Config.to_dict``'s) share it

    def _checked(self, c: Criterion, members: list[Member]) -> list[float]:
        values = []
        for m in members:
            try:
                value = float(c.fn(m))  # type: ignore[misc]
            except Exception as e:  # noqa: BLE001 - named and re-raised as the group's failure
                raise GroupRewardError(f"rubric criterion {c.name!r} raised {e!r}", failure_cause="rubric") from e
            if not math.isfinite(value):
                raise GroupRewardError(f"rubric criterion {c.name!r} returned {value!r}", failure_cause="rubric")
            values.append(value)
        return values

    async def __call__(self, group: PromptGroup) -> None:
        """Check every criterion on ``group``'s members, set their rewards and metadata (module docstring)."""
        judge = self.judge
        members = group_members(group, judge.member_text_fn if judge else default_member_text)
        task = judge.task_fn(group.row) if judge else ""
        texts = [m.text for m in members]
        judged = [c for c in self.criteria if c.judge is not None]
        judgements = dict(
            zip(
                (c.name for c in judged),
                await asyncio.gather(*(judge.judge(task, texts, c.judge) for c in judged)) if judged else [],
            )
        )
        values = {
            c.name: judgements[c.name].rewards if c.judge is not None else self._checked(c, members)
            for c in self.criteria
        }
        rewards = [sum(c.weight * values[c.name][i] for c in self.criteria) for i in range(len(members))]
        set_rewards(group, members, rewards)
        for i, m in enumerate(members):
            record: dict[str, Any] = {}
            for c in self.criteria:
                entry: dict[str, Any] = {"weight": c.weight, "value": values[c.name][i]}
                if c.judge is not None:
                    entry["judge"] = judgement_record(judgements[c.name], i, with_prompt=i == 0)
                record[c.name] = entry
            add_metadata(group, m.completion, "rubric", record, {c.name: values[c.name][i] for c in self.criteria})

    def take_metrics(self) -> dict[str, float]:
        """The judge's metrics (``GroupJudge.take_metrics``), {} without a judge."""
        return self.judge.take_metrics() if self.judge is not None else {}
