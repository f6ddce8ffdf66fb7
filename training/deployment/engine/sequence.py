"""One request's state inside the engine, from admission to its :class:`GenerationResult`.

Invariants:
- ``token_ids = prompt_token_ids + output_token_ids``; ``num_cached`` tokens of it have K/V in
  the blocks of ``block_table`` (position ``p`` in block ``block_table[p // block_size]``). After a
  prefill or a decode step the last token (just sampled) is the only one without K/V:
  ``num_cached == len(token_ids) - 1``, and the table has ``ceil(num_cached / block_size)`` blocks.
- A sequence holds blocks only while RUNNING. A preempted sequence is WAITING again with its tokens,
  logprobs, versions and generator kept and no blocks: its K/V is recomputed when it is admitted again.
- ``token_weight_versions[i]`` is the weight version whose forward produced the logits output
  token ``i`` was sampled from; the result's ``weight_version`` is the oldest of them.
"""

from __future__ import annotations

import enum
import itertools
from typing import Callable, Optional, Union

import torch

from training.deployment.engine.requests import GenerationResult, SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A prompt, its sampled tokens so far, and where its K/V lives."""

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator,
        stop_ids: frozenset[int],
        session_id: Optional[str] = None,
        on_finish: Optional[Callable[[GenerationResult], None]] = None,
    ):
        self.seq_id = next(_ids)
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.output_logprobs: list[float] = []
        self.token_weight_versions: list[int] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        """Per output token the ``params.top_logprobs`` best (id, logprob); empty when not asked."""
        self.params = params
        self.generator = generator
        self.stop_ids = stop_ids
        """Token ids that end this sequence (eos unless ignore_eos, plus stop_token_ids)."""
        self.session_id = session_id
        self.on_finish = on_finish
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        """KV blocks holding positions ``[0, num_cached)`` (shared prefix blocks first; the rest its own)."""
        self.num_cached = 0
        self.num_registered = 0
        """Leading blocks of ``block_table`` registered in the prefix tree (reusable by other requests)."""
        self.kv_epoch = -1
        """The scheduler's weight epoch its K/V was computed in (only the live epoch is ever shared)."""
        self.cached_prompt_tokens = 0
        self.finish_reason: Optional[str] = None
        self.text = ""
        self.matched_stop_string = False
        """True once ``text`` holds the output cut at a matched stop string."""
        self.stop_reason: Union[int, str, None] = None
        """The stop string or ``stop_token_ids`` entry that ended the sequence (None for eos and the rest)."""
        self.matcher = None
        """A constrained request's grammar state (``constraints.Matcher``), built by the engine at its first sampling."""
        self.on_token: Optional[Callable[[int, float, Optional[list[tuple[int, float]]], int], None]] = None
        """Streaming: called on the engine thread with each token that does not finish the sequence
        (token id, logprob, top alternatives or None, live weight version)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def append(
        self, token_id: int, logprob: float, weight_version: int, top_logprobs: Optional[list[tuple[int, float]]] = None
    ) -> None:
        """Record one token sampled under ``weight_version``; the K/V of the token before it is now cached."""
        self.num_cached = len(self.token_ids)
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.token_weight_versions.append(weight_version)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def result(self, weight_version: int) -> GenerationResult:
        """The finished output; ``weight_version`` (the live one) labels a result without tokens."""
        versions = list(self.token_weight_versions)
        return GenerationResult(
            prompt_token_ids=list(self.prompt_token_ids),
            output_token_ids=self.output_token_ids,
            output_logprobs=list(self.output_logprobs),
            finish_reason=self.finish_reason or "abort",
            weight_version=min(versions, default=weight_version),
            cached_prompt_tokens=self.cached_prompt_tokens,
            text=self.text,
            token_weight_versions=versions,
            stop_reason=self.stop_reason,
            output_top_logprobs=[list(t) for t in self.output_top_logprobs] if self.params.top_logprobs else None,
        )
