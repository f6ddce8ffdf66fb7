"""What a group judge is asked and how its answer is read: labels, the prompt, the JSON schema, parsing, normalising.

A group of ``G`` members is shown to the judge in one request, each under a label (``A``, ``B``, ... ``Z``, ``AA``,
...). The judge answers one JSON object with every label as a key and ``{"reason": str, "score": int}`` as value;
``answer_schema`` is that answer as a JSON schema (every label required, nothing else allowed, the score an integer
``enum`` of ``score_min..score_max``, the reason at most ``reason_max_chars`` characters), which constrained
decoding (``response_format`` ``json_schema``) makes the only thing a model can write. ``parse_answer`` reads an
answer with or without that constraint (the first JSON object in the text) and raises ``JudgeParseError`` naming
what is wrong.

Normalisation within the group (``normalise``), from the integer scores ``s_i`` in ``[lo, hi]``:

- ``minmax``: ``r_i = (s_i - min_j s_j) / (max_j s_j - min_j s_j)``; the best member gets 1, the worst 0; a group
  of equal scores gets 0.5 everywhere (no ranking: its advantages are 0 either way).
- ``rank``: ``r_i = (rank_i - 1) / (G - 1)``, rank 1 the lowest score, tied members sharing their mean rank; only
  the order counts, not the gaps.
- ``none``: ``r_i = (s_i - lo) / (hi - lo)``, the judge's absolute score scaled to [0, 1].

The recipe's advantages, ``(r_i - mean r) / (std r + eps)``, do not change under an affine map of a group's
rewards, so ``minmax`` and ``none`` train the same with ``advantage_std_scaling`` on; they differ in the logged
reward, and under mean-centring alone (Dr. GRPO). ``rank`` changes the advantages.
"""

from __future__ import annotations

import json
import math
from typing import Optional, Sequence

NORMALISATIONS = ("minmax", "rank", "none")
"""The ways scores become rewards within a group (module docstring)."""

SYSTEM_PROMPT = (
    "You are a strict, fair judge. You are shown one task and several responses to it, each under a label. "
    "Compare the responses with each other and score each one from {lo} (worst) to {hi} (best): a better "
    "response must get a higher score than a worse one. Give a short reason first, then the score. Answer with "
    "one JSON object whose keys are the labels {labels} and whose values are objects "
    '{{"reason": "...", "score": <integer {lo}..{hi}>}}, and nothing else.'
)


class JudgeParseError(ValueError):
    """The judge's answer is not the JSON object it was asked for; the message says what is wrong."""


def member_label(i: int) -> str:
    """The label of member ``i`` (0-based): ``A`` .. ``Z``, then ``AA``, ``AB``, ..."""
    if i < 0:
        raise ValueError(f"member index must be >= 0, got {i}")
    label = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        label = chr(ord("A") + r) + label
    return label


def build_messages(
    task: str, members: Sequence[str], rubric: Optional[str], lo: int, hi: int, member_max_chars: int
) -> list[dict]:
    """The chat messages of one group judgement: a system prompt with the instructions, then the task, the rubric
    (when given) and every member under its label. A member longer than ``member_max_chars`` is cut there (and the
    cut is marked)."""
    labels = [member_label(i) for i in range(len(members))]
    parts = [f"# Task\n{task.strip()}"]
    if rubric:
        parts.append(f"# Rubric\n{rubric.strip()}")
    shown = []
    for label, text in zip(labels, members):
        if len(text) > member_max_chars:
            text = text[:member_max_chars] + " [...cut]"
        shown.append(f"## Response {label}\n{text}")
    parts.append("# Responses\n" + "\n\n".join(shown))
    parts.append(f"Score every response: {', '.join(labels)}.")
    system = SYSTEM_PROMPT.format(lo=lo, hi=hi, labels=", ".join(labels))
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def answer_schema(num_members: int, lo: int, hi: int, reason_max_chars: Optional[int]) -> dict:
    """The JSON schema of the answer for ``num_members`` members (module docstring). ``reason_max_chars`` None: no
    length bound on the reasons (for hosted endpoints whose strict mode refuses ``maxLength``)."""
    reason: dict = {"type": "string"}
    if reason_max_chars is not None:
        reason["maxLength"] = reason_max_chars
    member = {
        "type": "object",
        "properties": {"reason": reason, "score": {"type": "integer", "enum": list(range(lo, hi + 1))}},
        "required": ["reason", "score"],
        "additionalProperties": False,
    }
    labels = [member_label(i) for i in range(num_members)]
    return {
        "type": "object",
        "properties": {label: member for label in labels},
        "required": labels,
        "additionalProperties": False,
    }


def _first_object(text: str) -> dict:
    """The JSON object ``text`` is, or the first one inside it (an answer wrapped in prose or a code fence)."""
    try:
        value = json.loads(text)
    except ValueError:
        start = text.find("{")
        while start != -1:
            try:
                value, _ = json.JSONDecoder().raw_decode(text, start)
                break
            except ValueError:
                start = text.find("{", start + 1)
        else:
            raise JudgeParseError(f"no JSON object in the judge's answer: {text[:200]!r}") from None
    if not isinstance(value, dict):
        raise JudgeParseError(f"the judge's answer is a {type(value).__name__}, not a JSON object: {text[:200]!r}")
    return value


def parse_answer(text: str, num_members: int, lo: int, hi: int) -> tuple[list[int], list[str]]:
    """(the score of each member, its reason) from the judge's answer; ``JudgeParseError`` naming the first label
    that is missing, has no integer score in ``[lo, hi]`` or no string reason."""
    value = _first_object(text)
    scores, reasons = [], []
    for i in range(num_members):
        label = member_label(i)
        entry = value.get(label)
        if not isinstance(entry, dict):
            raise JudgeParseError(f"the judge's answer has no object for response {label!r}: {text[:200]!r}")
        score = entry.get("score")
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise JudgeParseError(f"response {label!r}: score must be a number, got {score!r}")
        if score != int(score) or not lo <= score <= hi:
            raise JudgeParseError(f"response {label!r}: score must be an integer in [{lo}, {hi}], got {score!r}")
        reason = entry.get("reason", "")
        if not isinstance(reason, str):
            raise JudgeParseError(f"response {label!r}: reason must be a string, got {reason!r}")
        scores.append(int(score))
        reasons.append(reason)
    return scores, reasons


def normalise(scores: Sequence[float], method: str, lo: int, hi: int) -> list[float]:
    """The group's rewards from its scores (module docstring for each ``method``)."""
    if method not in NORMALISATIONS:
        raise ValueError(f"normalise: {method!r} is not one of {NORMALISATIONS}")
    n = len(scores)
    if method == "none":
        return [(s - lo) / (hi - lo) for s in scores]
    if method == "minmax":
        low, high = min(scores), max(scores)
        return [0.5] * n if high == low else [(s - low) / (high - low) for s in scores]
    if n == 1:
        return [0.5]
    order = sorted(range(n), key=lambda i: scores[i])
    ranks = [0.0] * n
    i = 0
    while i < n:  # tied scores share their mean rank
        j = i
        while j + 1 < n and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return [(r - 1) / (n - 1) for r in ranks]
