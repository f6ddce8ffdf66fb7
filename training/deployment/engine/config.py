"""Per-request sampling parameters, results and the error types of the engine (its settings,
``EngineConfig``, are declared once in ``training/utils/config.py`` and re-exported here).

Everything a caller of :class:`~training.deployment.engine.AsyncEngine` passes in or gets back
is defined here, so the HTTP server can import it without loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from training.utils.config import EngineConfig  # noqa: F401 - the engine's settings, declared once


class EngineError(ValueError):
    """A bad request; the message names the offending field (the server maps it to HTTP 400)."""


class WeightUpdateError(ValueError):
    """A refused weight update (missing, mismatched or extra tensor, named); the old weights stay live."""


class PartialWeightUpdateError(RuntimeError):
    """A streamed weight update failed after some tensors were overwritten: the live weights are a mix.

    The engine then reports ``weight_version = -1`` (unknown) until a later full update succeeds.
    """


@dataclass
class SamplingParams:
    """How one request samples. Logprobs are taken under ``logits / temperature`` (see sampling.py)."""

    max_tokens: int = 16
    """Most output tokens (>= 1)."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    seed: Optional[int] = None
    """Per-request seed: the same seed gives the same sample whatever else is in the batch."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, checked on the decoded output; removed from ``text`` (tokens are kept)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the output, in addition to the model's eos ids."""
    ignore_eos: bool = False
    """Keep generating past eos tokens (``stop_token_ids`` still stop)."""


@dataclass
class GenerationResult:
    """The finished output of one request."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Every sampled token, the stop token included."""
    output_logprobs: list[float]
    """One per output token: log-probability under the temperature-scaled full distribution."""
    finish_reason: str
    """``stop`` (eos, stop token or stop string), ``length`` (max_tokens / max_model_len) or ``abort``."""
    weight_version: int
    """The OLDEST version among ``token_weight_versions`` (conservative for the off-policy gate)."""
    cached_prompt_tokens: int
    """Prompt tokens whose K/V was reused (prefix cache or session), not computed for this request."""
    text: str
    """Decoded output without special tokens; a matched stop string and what follows it are removed."""
    token_weight_versions: list[int] = field(default_factory=list)
    """One per output token: the weight version whose forward produced it (in-flight updates mix versions)."""


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                     max_model_len: int) -> None:
    """Raise :class:`EngineError` naming the field when a request cannot be served."""
    if not isinstance(params, SamplingParams):
        raise EngineError(f"params: expected SamplingParams, got {type(params).__name__}")
    if not prompt_token_ids:
        raise EngineError("prompt_token_ids: must not be empty")
    for i, t in enumerate(prompt_token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise EngineError(f"prompt_token_ids[{i}]: {t!r} is not a token id in [0, {vocab_size})")
    if isinstance(params.max_tokens, bool) or not isinstance(params.max_tokens, int) or params.max_tokens < 1:
        raise EngineError(f"max_tokens: must be an integer >= 1, got {params.max_tokens!r}")
    if len(prompt_token_ids) + params.max_tokens > max_model_len:
        raise EngineError(f"max_tokens: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                          f"({params.max_tokens}) exceeds max_model_len ({max_model_len})")
    if not isinstance(params.temperature, (int, float)) or not params.temperature >= 0:
        raise EngineError(f"temperature: must be >= 0, got {params.temperature!r}")
    if not isinstance(params.top_p, (int, float)) or not 0 < params.top_p <= 1:
        raise EngineError(f"top_p: must be in (0, 1], got {params.top_p!r}")
    if params.seed is not None and (isinstance(params.seed, bool) or not isinstance(params.seed, int)):
        raise EngineError(f"seed: must be an integer or None, got {params.seed!r}")
    if not isinstance(params.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in params.stop):
        raise EngineError(f"stop: must be a list of non-empty strings, got {params.stop!r}")
    for i, t in enumerate(params.stop_token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise EngineError(f"stop_token_ids[{i}]: {t!r} is not a token id in [0, {vocab_size})")
