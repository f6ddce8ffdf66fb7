"""Per-request sampling parameters, results and the error types of the engine (its settings,
``EngineConfig``, are declared once in ``training/utils/config.py`` and re-exported here).

Everything a caller of :class:`~training.deployment.engine.AsyncEngine` passes in or gets back
is defined here, so the HTTP server can import it without loading a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from training.deployment.engine.constraints import Constraint, check_constraint
from training.utils.config import EngineConfig  # noqa: F401 - the engine's settings, declared once

MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a request may ask for (``top_logprobs``; OpenAI's limit)."""


class EngineError(ValueError):
    """A bad request; the message names the offending field (the server maps it to HTTP 400)."""


class EngineBusyError(RuntimeError):
    """The engine's waiting queue is full (``EngineConfig.max_waiting``): retry later (the server answers 503
    with ``Retry-After``). Nothing already accepted is affected."""


class WeightUpdateError(ValueError):
    """A refused weight update (missing, mismatched or extra tensor, named); the old weights stay live."""


class PartialWeightUpdateError(RuntimeError):
    """A streamed weight update failed after some tensors were overwritten: the live weights are a mix.

    The engine then reports ``weight_version = -1`` (unknown) until a later full update succeeds.
    """


@dataclass
class SamplingParams:
    """How one request samples. The reported logprob is the model's, at ``temperature`` (see token_sampler.py).

    Processing order (as vLLM): ``min_tokens`` mask, ``logit_bias``, repetition / frequency /
    presence penalties, temperature, ``min_p``, ``top_k``, ``top_p``, then one draw. None of
    them changes the reported logprob: it is ``log_softmax(logits / T)`` of the raw logits, except
    that a ``constraint`` masks the logits first (the logprob is then that of the masked distribution).
    """

    max_tokens: int = 16
    """Most output tokens (>= 1)."""
    temperature: float = 1.0
    """Softmax temperature (finite, >= 0); 0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1], taken over the tokens ``top_k`` and ``min_p`` kept; the top token is always kept."""
    seed: Optional[int] = None
    """Per-request seed: the same seed gives the same sample whatever else is in the batch."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, checked on the decoded output; removed from ``text`` (tokens are kept)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the output, in addition to the model's eos ids."""
    ignore_eos: bool = False
    """Keep generating past eos tokens (``stop_token_ids`` still stop)."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens; 0 = all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the top token's, in [0, 1]; 0 = off."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output, in [-2, 2] (OpenAI)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output, in [-2, 2] (OpenAI)."""
    repetition_penalty: float = 1.0
    """CTRL penalty on tokens of the prompt or output: positive logits / r, negative × r; r in [0.01, 100]; 1 = off."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> value in [-100, 100] added to its logit before sampling (OpenAI)."""
    min_tokens: int = 0
    """Stop tokens (eos, ``stop_token_ids``) are masked and stop strings unchecked until this many tokens exist."""
    top_logprobs: int = 0
    """Alternatives per output token: the ``top_logprobs`` most likely tokens and their logprobs (0..20)."""
    include_stop_str_in_output: bool = False
    """Keep a matched stop string at the end of ``text`` (what follows it is still removed)."""
    constraint: Optional[Constraint] = None
    """Grammar the output must follow (constraints.py): tokens outside it get logit -inf before everything
    else, the reported logprob is the masked distribution's, and the output ends when the grammar is complete."""

    @property
    def needs_processing(self) -> bool:
        """Whether anything changes the logits before the temperature (bias, penalties, min_tokens)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.has_penalties

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p removes tokens from the sampling distribution."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


@dataclass
class GenerationResult:
    """The finished output of one request."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Every sampled token, the stop token included."""
    output_logprobs: list[float]
    """One per output token: log-probability under the temperature-scaled full distribution (masked by the
    grammar for a request with ``constraint``)."""
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
    stop_reason: Union[int, str, None] = None
    """What ended a ``stop``: the matched stop string, or the token id when it is one of ``stop_token_ids``;
    None for an eos token and for every other finish reason (as vLLM)."""
    output_top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    """With ``top_logprobs = k > 0``: per output token, the k most likely (token id, logprob), best first."""


@dataclass
class GenerationDelta:
    """What one streamed request gained since the previous delta (``AsyncEngine.generate_stream``)."""

    token_ids: list[int]
    """New output tokens, in order (the final delta carries the last ones, stop token included)."""
    logprobs: list[float]
    """One per new token, as ``GenerationResult.output_logprobs``."""
    top_logprobs: Optional[list[list[tuple[int, float]]]]
    """One list per new token with ``top_logprobs > 0``, else None."""
    weight_versions: list[int] = field(default_factory=list)
    """One per new token: the weight version live in the step that sampled it."""
    result: Optional[GenerationResult] = None
    """Set on the last delta only: the whole finished result (``text``, ``finish_reason``, ...)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped on an error (``reason``): nothing more will be generated by this engine; the
    server answers 503 on ``/health`` and on every request with the reason."""

    def __init__(self, reason: str):
        super().__init__(f"the engine thread died: {reason}")
        self.reason = reason


class SequenceFailedError(RuntimeError):
    """One sequence could not be sampled or post-processed; it alone ends (the server maps it to HTTP 500)."""


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
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
        raise EngineError(
            f"max_tokens: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
            f"({params.max_tokens}) exceeds max_model_len ({max_model_len})"
        )
    _check_number(params.temperature, "temperature", 0.0, math.inf, "a finite number >= 0")
    _check_number(params.top_p, "top_p", 0.0, 1.0, "in (0, 1]", low_open=True)
    if params.seed is not None and (not _is_int(params.seed) or not -(2**63) <= params.seed < 2**64):
        raise EngineError(f"seed: must be None or an integer in [-2**63, 2**64), got {params.seed!r}")
    if not isinstance(params.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in params.stop):
        raise EngineError(f"stop: must be a list of non-empty strings, got {params.stop!r}")
    for i, t in enumerate(params.stop_token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise EngineError(f"stop_token_ids[{i}]: {t!r} is not a token id in [0, {vocab_size})")
    if not _is_int(params.top_k) or params.top_k < 0:
        raise EngineError(f"top_k: must be an integer >= 0 (0 = all tokens), got {params.top_k!r}")
    _check_number(params.min_p, "min_p", 0.0, 1.0, "in [0, 1]")
    _check_number(params.presence_penalty, "presence_penalty", -2.0, 2.0, "in [-2, 2]")
    _check_number(params.frequency_penalty, "frequency_penalty", -2.0, 2.0, "in [-2, 2]")
    _check_number(params.repetition_penalty, "repetition_penalty", 0.01, 100.0, "in [0.01, 100]")
    if not isinstance(params.logit_bias, dict):
        raise EngineError(f"logit_bias: must be a dict of token id -> bias, got {type(params.logit_bias).__name__}")
    for t, b in params.logit_bias.items():
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise EngineError(f"logit_bias: key {t!r} is not a token id in [0, {vocab_size})")
        _check_number(b, "logit_bias", -100.0, 100.0, f"values in [-100, 100] (token {t})")
    if not _is_int(params.min_tokens) or not 0 <= params.min_tokens <= params.max_tokens:
        raise EngineError(
            f"min_tokens: must be an integer in [0, max_tokens={params.max_tokens}], got {params.min_tokens!r}"
        )
    if not _is_int(params.top_logprobs) or not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise EngineError(f"top_logprobs: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {params.top_logprobs!r}")
    if not isinstance(params.include_stop_str_in_output, bool):
        raise EngineError(f"include_stop_str_in_output: must be a boolean, got {params.include_stop_str_in_output!r}")
    if params.constraint is not None and (problem := check_constraint(params.constraint)) is not None:
        raise EngineError(f"constraint: {problem}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_number(x, name: str, lo: float, hi: float, expected: str, low_open: bool = False) -> None:
    """Raise EngineError unless ``x`` is a real number in [lo, hi] (``(lo, hi]`` when ``low_open``)."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and lo <= x <= hi
    if not ok or (low_open and x == lo):
        raise EngineError(f"{name}: must be {expected}, got {x!r}")


def validate_kv_fit(prompt_len: int, max_tokens: int, max_model_len: int, block_size: int, num_blocks: int) -> None:
    """Raise :class:`EngineError` when a request alone could never fit the KV cache's block pool.

    A sequence holds K/V for every token but its last: at most ``min(prompt + max_tokens, max_model_len) - 1``
    positions, in blocks of ``block_size``; preemption gives a lone sequence the whole pool, never more."""
    positions = max(prompt_len, min(prompt_len + max_tokens, max_model_len) - 1)
    need = -(-positions // block_size)
    if need <= num_blocks:
        return
    field = "prompt_token_ids" if -(-prompt_len // block_size) > num_blocks else "max_tokens"
    raise EngineError(
        f"{field}: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs up to {need} KV cache blocks of "
        f"{block_size} tokens, but the pool holds {num_blocks} ({num_blocks * block_size} tokens): raise "
        f"EngineConfig.kv_cache_memory_bytes (or kv_cache_memory_fraction; deployment.engine_config.*) or ask "
        f"for fewer tokens"
    )
