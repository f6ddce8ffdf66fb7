"""Engine settings, per-request sampling parameters, results and the two error types.

Everything a caller of :class:`~training.deployment.engine.AsyncEngine` passes in or gets back
is defined here, so the HTTP server can import it without loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


class EngineError(ValueError):
    """A bad request; the message names the offending field (the server maps it to HTTP 400)."""


class WeightUpdateError(ValueError):
    """A refused weight update (missing, mismatched or extra tensor, named); the old weights stay live."""


class PartialWeightUpdateError(RuntimeError):
    """A streamed weight update failed after some tensors were overwritten: the live weights are a mix.

    The engine then reports ``weight_version = -1`` (unknown) until a later full update succeeds.
    """


@dataclass
class EngineConfig:
    """How the engine loads the model and sizes its KV cache."""

    model: str
    """Local Hugging Face folder (or a hub id, which uses the transformers fallback)."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "auto"
    """``auto`` is bfloat16 on CUDA and float32 on CPU; or ``float32`` / ``bfloat16`` / ``float16``."""
    max_batch_size: int = 64
    """KV cache slots = sequences decoded at once (running plus parked sessions)."""
    max_model_len: int = 2048
    """Prompt + output tokens per sequence."""
    seed: int = 0
    """Seeds the per-request generators of requests that bring no seed of their own."""
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    """Decode batch buckets captured as CUDA graphs (clipped to ``max_batch_size``); empty = eager."""
    use_lean_forward: bool = True
    """Own forward for llama / qwen2 / qwen3 (fused projections); else transformers' forward."""
    max_prefill_tokens: int = 4096
    """Prompt tokens prefilled in one step (a longer single prompt still runs, alone)."""
    enable_prefix_caching: bool = True
    """Reuse K/V of any cached prompt prefix across requests (no session id needed); False: sessions only."""
    prefix_cache_slots: int = 0
    """KV slots beyond ``max_batch_size`` that only hold cached prefixes (finished sequences, parked sessions)."""
    inflight_update_kv: str = "keep"
    """An update with ``wait_for_inflight=False``: running sequences ``keep`` their K/V (PipelineRL), or
    ``recompute`` it under the new weights before the next decode step."""

    def __post_init__(self):
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {msg}")

        check(bool(self.model), "model", "must be a folder or hub id")
        check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device",
              f"{self.device!r} is not one of ('auto', 'cpu', 'cuda', 'cuda:N')")
        check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
              f"{self.dtype!r} is not one of ('auto', 'float32', 'bfloat16', 'float16')")
        check(self.max_batch_size > 0, "max_batch_size", f"must be > 0, got {self.max_batch_size}")
        check(self.max_model_len > 1, "max_model_len", f"must be > 1, got {self.max_model_len}")
        check(all(b > 0 for b in self.cuda_graph_batch_sizes), "cuda_graph_batch_sizes", "must be positive")
        check(self.max_prefill_tokens > 0, "max_prefill_tokens", f"must be > 0, got {self.max_prefill_tokens}")
        check(self.prefix_cache_slots >= 0, "prefix_cache_slots", f"must be >= 0, got {self.prefix_cache_slots}")
        check(self.inflight_update_kv in ("keep", "recompute"), "inflight_update_kv",
              f"{self.inflight_update_kv!r} is not one of ('keep', 'recompute')")
        self.cuda_graph_batch_sizes = tuple(sorted(set(self.cuda_graph_batch_sizes)))

    def resolve_device(self) -> torch.device:
        """The torch device ``device`` names (``auto`` → cuda if available)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """The torch dtype ``dtype`` names (``auto`` → bfloat16 on CUDA, float32 on CPU)."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


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
