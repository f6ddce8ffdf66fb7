"""The checkable instructions of this example and their Python verifier (held out: training never calls it).

Each row carries one ``constraint``: ``{"kind": ..., "arg": ...}``.

| kind | the instruction | passes when |
| --- | --- | --- |
| ``lowercase`` | write in lower case only | the reply has a letter and no upper-case letter |
| ``max_words`` | at most ``arg`` words | 1 <= number of whitespace-separated words <= ``arg`` |
| ``keyword`` | use the word ``arg`` | ``arg`` occurs as a whole word (any case) |
| ``no_commas`` | no commas | the reply is not empty and holds no ``,`` |
"""

from __future__ import annotations

import re

KINDS = ("lowercase", "max_words", "keyword", "no_commas")


def instruction(constraint: dict) -> str:
    """The sentence the prompt states for ``constraint``."""
    kind, arg = constraint["kind"], constraint.get("arg")
    if kind == "lowercase":
        return "Write your whole answer in lower case letters only."
    if kind == "max_words":
        return f"Answer in at most {arg} words."
    if kind == "keyword":
        return f"Use the word '{arg}' in your answer."
    if kind == "no_commas":
        return "Do not use any commas in your answer."
    raise ValueError(f"constraint kind: {kind!r} is not one of {KINDS}")


def follows(text: str, constraint: dict) -> bool:
    """Whether ``text`` (the reply) follows ``constraint`` (the module docstring's table)."""
    kind, arg = constraint["kind"], constraint.get("arg")
    text = text.strip()
    if kind == "lowercase":
        return any(c.isalpha() for c in text) and not any(c.isupper() for c in text)
    if kind == "max_words":
        return 1 <= len(text.split()) <= int(arg)
    if kind == "keyword":
        return re.search(rf"\b{re.escape(str(arg))}\b", text, flags=re.IGNORECASE) is not None
    if kind == "no_commas":
        return bool(text) and "," not in text
    raise ValueError(f"constraint kind: {kind!r} is not one of {KINDS}")
