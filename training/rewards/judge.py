"""``GroupJudge``: group-relative judge rewards (after RULER): one judge request ranks the members of a prompt group.

    from training.rewards import GroupJudge, JudgeConfig

    judge = GroupJudge(JudgeConfig(model="smollm2"), rubric="Follows every instruction; short.")
    cfg = Config(..., group_reward_fn=judge)   # awaited on each finished training group

The judge sees the task (``task_fn(row)``: the row's ``prompt``, its chat ``messages``, or its ``question``), the
rubric (the ``rubric`` given here, else the row's ``rubric`` field, else none) and every surviving member under a
label (``member_text_fn``: the texts of the member's samples, one per line; a whole agent trajectory from the proxy
is its segments' texts), and answers a score and a reason per member (``judge_prompt.py``: the prompt, the JSON
schema, the parsing). The scores are normalised within the group (``normalise``: ``minmax`` by default, ``rank``,
``none``; the formulas are in ``judge_prompt.py``) and become the members' rewards, replacing what the rollout
returned (a ``Rubric`` can mix the two: ``rubric.py``).

What is written (``rollouts.jsonl``, through ``PromptGroup.metadata``): every member's record gets ``judge``:
``{"call", "label", "score", "reason", "reward", "cached"}`` (``call``: the request's content key, shared by the
group); the first member's also holds the whole ``prompt`` (the chat messages), the ``raw`` answer and every
member's ``scores``. ``reward_components`` gets ``<name>`` (the normalised reward) and ``<name>_score`` (the score
scaled to [0, 1], comparable across groups), so the step metrics show ``reward/judge`` and ``reward/judge_score``.

A judge that gives no usable answer raises ``JudgeError``: the recipe drops the group and counts its completions
under ``rollout/failed/judge`` (``training/utils/rl/group_reward.py``). Step metrics: ``take_metrics`` (the client's
``judge/*``, with ``judge/groups`` and ``judge/time_share``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from training.rewards.judge_client import JudgeAnswer, JudgeClient, JudgeConfig
from training.rewards.judge_prompt import (
    NORMALISATIONS,
    answer_schema,
    build_messages,
    member_label,
    normalise,
    parse_answer,
)
from training.utils.rl.groups import PromptGroup
from training.utils.rl.rollout import RolloutSample

MemberTextFn = Callable[[list[RolloutSample], Optional[dict]], str]
"""``fn(samples of one completion, its RolloutRun metadata or None) -> the text the judge reads``."""


@dataclass
class Member:
    """One surviving completion of a group, as a reward sees it."""

    completion: int
    """Its completion index in the group (``PromptGroup.completion_index``)."""
    text: str
    """What the judge reads (``member_text_fn``)."""
    reward: float
    """The reward its ``rollout_fn`` returned."""
    row: dict
    metadata: Optional[dict]
    """Its ``RolloutRun.metadata``, if any."""


@dataclass
class GroupJudgement:
    """A judge's answer about one group: per member the score, the reason and the normalised reward."""

    scores: list[int]
    reasons: list[str]
    rewards: list[float]
    answer: JudgeAnswer


def default_task(row: dict) -> str:
    """The task the judge reads: the row's ``prompt`` (a string, or chat messages), else ``messages``, else
    ``question``; else the row as JSON."""
    for key in ("prompt", "messages", "question"):
        value = row.get(key)
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
            return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in value)
    return json.dumps({k: v for k, v in row.items() if not k.endswith("_ids")}, default=str)[:4000]


def default_member_text(samples: list[RolloutSample], metadata: Optional[dict]) -> str:
    """The member's samples' texts, one per line (one sample: its text)."""
    return "\n".join(s.text for s in samples)


def group_members(group: PromptGroup, member_text_fn: MemberTextFn = default_member_text) -> list[Member]:
    """The surviving completions of ``group``, in completion order."""
    members = []
    for k in sorted(group.completion_rewards):
        samples = [s for s, c in zip(group.samples, group.completion_index) if c == k]
        meta = group.metadata.get(k)
        members.append(Member(k, member_text_fn(samples, meta), group.completion_rewards[k], group.row, meta))
    return members


def set_rewards(group: PromptGroup, members: Sequence[Member], rewards: Sequence[float]) -> None:
    """Member ``i``'s completion gets reward ``rewards[i]``: the completion's, and its samples' by their share
    (``PromptGroup.set_completion_reward``: a per-call-credit segment keeps its per-call part)."""
    for m, r in zip(members, rewards):
        group.set_completion_reward(m.completion, float(r))


def add_metadata(group: PromptGroup, completion: int, key: str, value: Any, components: dict[str, float]) -> None:
    """Merge ``{key: value}`` and ``reward_components`` into the completion's metadata (kept: what the run had)."""
    meta = dict(group.metadata.get(completion) or {})
    meta[key] = value
    meta["reward_components"] = {**(meta.get("reward_components") or {}), **components}
    group.metadata[completion] = meta


class GroupJudge:
    """A group reward (``Config.group_reward_fn``) that has a judge rank each group's members (module docstring)."""

    def __init__(
        self,
        judge: Union[JudgeConfig, JudgeClient],
        *,
        rubric: Optional[str] = None,
        normalise: str = "minmax",
        task_fn: Callable[[dict], str] = default_task,
        member_text_fn: MemberTextFn = default_member_text,
        name: str = "judge",
    ):
        if normalise not in NORMALISATIONS:
            raise ValueError(f"normalise: {normalise!r} is not one of {NORMALISATIONS}")
        if not name or not name.replace("_", "").isalnum():
            raise ValueError(f"name: must be a metric-safe word (letters, digits, _), got {name!r}")
        self.client = judge if isinstance(judge, JudgeClient) else JudgeClient(judge)
        self.rubric = rubric
        self.normalise = normalise
        self.task_fn = task_fn
        self.member_text_fn = member_text_fn
        self.name = name
        self.__name__ = name  # how Config.to_dict records it
        self._groups = 0

    def __deepcopy__(self, memo: dict) -> "GroupJudge":
        return self  # holds a live client: copies (``Config.to_dict``'s) share it

    async def judge(self, task: str, texts: Sequence[str], rubric: Optional[str]) -> GroupJudgement:
        """Ask the judge about ``texts`` (one group's members) and normalise its scores within them."""
        cfg = self.client.cfg
        lo, hi, n = cfg.score_min, cfg.score_max, len(texts)
        messages = build_messages(task, texts, rubric, lo, hi, cfg.member_max_chars)
        schema = answer_schema(n, lo, hi, cfg.reason_max_chars)
        answer = await self.client.judge(messages, schema, lambda raw: parse_answer(raw, n, lo, hi))
        scores, reasons = answer.parsed
        return GroupJudgement(scores, reasons, normalise(scores, self.normalise, lo, hi), answer)

    def rubric_for(self, row: dict) -> Optional[str]:
        """The rubric given here, else the row's ``rubric`` field (a string), else None."""
        value = self.rubric if self.rubric is not None else row.get("rubric")
        return value if isinstance(value, str) and value.strip() else None

    async def __call__(self, group: PromptGroup) -> None:
        """Score ``group``'s members together and set their rewards and metadata; ``JudgeError`` when it cannot."""
        members = group_members(group, self.member_text_fn)
        j = await self.judge(self.task_fn(group.row), [m.text for m in members], self.rubric_for(group.row))
        set_rewards(group, members, j.rewards)
        lo, hi = self.client.cfg.score_min, self.client.cfg.score_max
        for i, m in enumerate(members):
            add_metadata(
                group,
                m.completion,
                self.name,
                judgement_record(j, i, with_prompt=i == 0),
                {self.name: j.rewards[i], f"{self.name}_score": (j.scores[i] - lo) / (hi - lo)},
            )
        self._groups += 1

    def take_metrics(self) -> dict[str, float]:
        """The client's ``judge/*`` metrics since the last call, with ``judge/groups`` (groups scored)."""
        out = self.client.take_metrics()
        out["judge/groups"] = float(self._groups)
        self._groups = 0
        return out

    def start(self) -> "GroupJudge":
        self.client.start()
        return self

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "GroupJudge":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def judgement_record(j: GroupJudgement, i: int, with_prompt: bool) -> dict:
    """Member ``i``'s part of a judgement, as written to ``rollouts.jsonl`` (module docstring)."""
    record: dict[str, Any] = {
        "call": j.answer.key,
        "label": member_label(i),
        "score": j.scores[i],
        "reason": j.reasons[i],
        "reward": j.rewards[i],
        "cached": j.answer.cached,
    }
    if with_prompt:
        record["prompt"] = j.answer.request["messages"]
        record["raw"] = j.answer.raw
        record["scores"] = {member_label(k): s for k, s in enumerate(j.scores)}
    return record
