"""The server's per-request limits (``RequestLimits``) and the checks that enforce them.

A request that would cost the server far more than a normal one (65,536 sequences, 300,000 stop
strings, a chat template padded to 20 M tokens) or that names something impossible (a path with a
NUL byte, a join timeout of 5e-324 s) is refused with a 400 naming the field and the limit,
before any work or connection is tried. The limits are server settings: ``create_app(...,
limits=RequestLimits(...))``, or ``serve.py`` flags of the same names (``--max-stop-strings 8``).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any, Optional

from training.deployment.server.request_error import RequestError


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits of the deployment server (a 400 naming the limit when exceeded)."""

    max_sequences_per_request: int = 1024
    """Sequences one generation request may start: ``n`` × the number of prompts."""
    max_stop_strings: int = 64
    """Entries of ``stop`` (each is matched against the output after every token)."""
    max_stop_chars: int = 4096
    """Characters of all ``stop`` strings together."""
    max_stop_token_ids: int = 1024
    """Entries of ``stop_token_ids``."""
    max_join_timeout_s: float = 3600.0
    """Largest ``timeout_s`` of ``/init_weight_update_group`` (the smallest is 1 s)."""

    def __post_init__(self):
        for name in ("max_sequences_per_request", "max_stop_strings", "max_stop_chars", "max_stop_token_ids"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        if not isinstance(self.max_join_timeout_s, (int, float)) or not 1.0 <= self.max_join_timeout_s <= 86400.0:
            raise ValueError(f"max_join_timeout_s: must be in [1, 86400], got {self.max_join_timeout_s!r}")


DEFAULT_LIMITS = RequestLimits()

MIN_JOIN_TIMEOUT_S = 1.0
"""Smallest ``timeout_s`` of ``/init_weight_update_group``: shorter cannot open a TCP store."""
MAX_PATH_BYTES = 4096
"""Longest weight path (UTF-8 bytes; Linux's PATH_MAX)."""
MAX_NAME_BYTES = 255
"""Longest component of a weight path (Linux's NAME_MAX)."""


def check_sequences(n: int, num_prompts: int, limits: RequestLimits) -> None:
    """Refuse ``n`` × prompts above ``max_sequences_per_request``."""
    total = n * num_prompts
    if total > limits.max_sequences_per_request:
        raise RequestError(
            f"'n'={n} × {num_prompts} prompt(s) = {total} sequences exceeds max_sequences_per_request="
            f"{limits.max_sequences_per_request}; split the request",
            "n",
        )


def check_stop(stop: list[str], stop_token_ids: list[int], limits: RequestLimits) -> None:
    """Refuse more stop strings (or characters, or stop token ids) than the limits allow."""
    if len(stop) > limits.max_stop_strings:
        raise RequestError(
            f"'stop' holds {len(stop)} strings; at most max_stop_strings={limits.max_stop_strings}", "stop"
        )
    chars = sum(map(len, stop))
    if chars > limits.max_stop_chars:
        raise RequestError(
            f"'stop' strings hold {chars} characters; at most max_stop_chars={limits.max_stop_chars}", "stop"
        )
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise RequestError(
            f"'stop_token_ids' holds {len(stop_token_ids)} ids; at most max_stop_token_ids={limits.max_stop_token_ids}",
            "stop_token_ids",
        )


def check_join_timeout(value: Any, limits: RequestLimits) -> float:
    """``timeout_s`` of a join, a number in [1, ``max_join_timeout_s``] (400 naming it otherwise)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not MIN_JOIN_TIMEOUT_S <= value <= limits.max_join_timeout_s:
        raise RequestError(
            f"'timeout_s' must be a number of seconds in [{MIN_JOIN_TIMEOUT_S:g}, {limits.max_join_timeout_s:g}] "
            f"(max_join_timeout_s), got {value!r}",
            "timeout_s",
        )
    return float(value)


def check_weight_path(path: Any) -> str:
    """A weight path that the filesystem can look up: a non-empty string without NUL bytes, valid
    UTF-8, at most ``MAX_PATH_BYTES`` long with components of at most ``MAX_NAME_BYTES``. The
    message quotes only what the client sent."""
    if not isinstance(path, str) or not path:
        raise RequestError("'path' must be a non-empty string", "path")
    if "\x00" in path:
        raise RequestError("'path' contains a NUL byte", "path")
    try:
        raw = os.fsencode(path) if path.isascii() else path.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("'path' is not valid UTF-8 (a lone surrogate)", "path") from None
    if len(raw) > MAX_PATH_BYTES:
        raise RequestError(f"'path' is {len(raw)} bytes long; at most {MAX_PATH_BYTES}", "path")
    if any(len(part) > MAX_NAME_BYTES for part in raw.split(b"/")):
        raise RequestError(f"'path' has a component longer than {MAX_NAME_BYTES} bytes", "path")
    return path


# ---------------------------------------------------------------- chat_template_kwargs

_TEMPLATE_OWN = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt"})
"""Variables the server itself passes to every chat template."""


def _apply_kwargs(tokenizer: Any) -> frozenset[str]:
    """The parameters of ``tokenizer.apply_chat_template`` (tokenize, padding, max_length, ...)."""
    try:
        return frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    except (TypeError, ValueError):
        return frozenset()


def template_variables(tokenizer: Any, tools: Optional[list]) -> Optional[frozenset[str]]:
    """The undeclared variables of the chat template the tokenizer would use (``None`` if unknown)."""
    try:
        import jinja2
        from jinja2 import meta
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        source = tokenizer.get_chat_template(None, tools)
        env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        return frozenset(meta.find_undeclared_variables(env.parse(source)))
    except (jinja2.TemplateError, ValueError, TypeError, AttributeError):
        return None


def check_template_kwargs(kwargs: dict, tokenizer: Any, tools: Optional[list]) -> None:
    """Refuse a ``chat_template_kwargs`` key that is not a variable of the chat template: the
    tokenizer's own options (``tokenize``, ``padding``, ``max_length``, ``return_tensors`` ...),
    the variables the server sets, special-token names, and names the template never reads."""
    own = _apply_kwargs(tokenizer) | _TEMPLATE_OWN | frozenset(getattr(tokenizer, "special_tokens_map", {}) or {})
    variables = template_variables(tokenizer, tools)
    for key in kwargs:
        if not isinstance(key, str) or key in own:
            raise RequestError(
                f"'chat_template_kwargs.{key}' is not allowed: only the chat template's own variables may be set",
                "chat_template_kwargs",
            )
        if variables is not None and key not in variables:
            known = sorted(variables - own)
            raise RequestError(
                f"'chat_template_kwargs.{key}' is not a variable of this model's chat template (it reads {known})",
                "chat_template_kwargs",
            )
