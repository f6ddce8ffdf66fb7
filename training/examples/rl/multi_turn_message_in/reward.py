"""Scoring for the multi-turn example: the first integer in the reply against the answer."""

import re


def parse_answer(text: str) -> str | None:
    """The first integer in ``text`` (as written), or None."""
    m = re.search(r"-?\d+", text)
    return m.group(0) if m else None


def score(text: str, answer: str) -> float:
    """1.0 if the reply's first integer is the answer, else 0.0."""
    return 1.0 if parse_answer(text) == answer else 0.0
