"""The one builder of token / logprob / loss-mask / weight-version samples from model calls.

Every producer of ``RolloutSample``s out of recorded calls builds them here: the in-process agents
(``training/agents/trajectory.py``, and through them the environment adapters of ``training/envs``),
the proxy's stitching (``training/proxy/stitching.py``) and per-call transitions
(``training/utils/rl/credit.py``, used by both). So the same calls give the same samples on every path.

A ``SampleBuilder`` is one unbroken token sequence under construction, four parallel lists:

- ``add_context(ids)``: ids the sampler did not generate for this sample (a prompt, template glue, tool
  results): mask 0, logprob 0.0, no weight version;
- ``add_output(call)``: a call's output ids: mask 1 with the sampler's logprobs and their weight versions;
  an untrained call's output (``call.trainable`` False: a constrained call under
  ``constrained_calls="exclude"``) goes in as context instead (mask 0, logprob 0.0);
- ``add_call(call)``: the call's prompt ids past the builder's tokens (the prompt must extend them), as
  context, then its output: turn k+1 of a conversation whose prompt is turn k's prompt + output + glue;
- ``truncate(n)`` keeps the first ``n`` tokens; ``to_sample(reward, max_seq_len=)`` gives the sample
  (cut to ``max_seq_len``, ``finish_reason="length"`` then), or None when no token is trainable.

Weight versions, the one convention:

- a generated token's weight version is its call's per-token version (``token_weight_versions``, the
  server's, when an in-flight update may mix versions within one call), else the call's
  ``weight_version`` for every token (``call_weight_versions``);
- a context token has no version: ``CONTEXT_VERSION`` (-1) in the builder's parallel list, never in a
  sample;
- a sample's ``token_weight_versions`` lists the versions of its trainable tokens (``loss_mask`` 1) in
  order; when any of them is unknown (negative: an upstream that reported none), the sample carries
  None (unknown, the contract's value for it) rather than a list the contract would refuse.

A segment's ``finish_reason`` is its last output's (``length`` when ``to_sample`` cuts it, or when the
caller passes one: an agent stopped for lack of room).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from training.utils.rl.rollout import RolloutSample

CONTEXT_VERSION = -1
"""The weight version the builder records for a context token (none generated it)."""


def call_weight_versions(token_weight_versions: Optional[Sequence[int]], weight_version: int, n: int) -> list[int]:
    """The weight version of each of a call's ``n`` output tokens: the per-token versions when the server
    reported them, else ``weight_version`` for every token."""
    if token_weight_versions:
        return [int(v) for v in token_weight_versions]
    return [int(weight_version)] * n


@dataclass
class CallTokens:
    """One model call's exact token ids, as the server returned them: what the builder consumes."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    """Sampler logprob of each output token (parallel to ``output_ids``)."""
    output_weight_versions: list[int]
    """Weight version of each output token (``call_weight_versions``; negative = unknown)."""
    finish_reason: str
    index: int = 0
    """Position of the call in its episode."""
    trainable: bool = True
    """False: the output is context (mask 0), e.g. a constrained call under ``constrained_calls="exclude"``."""


@dataclass
class SampleBuilder:
    """One unbroken token sequence under construction (parallel lists; module docstring)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    """Parallel to ``tokens``: a generated token's weight version, ``CONTEXT_VERSION`` on context."""
    calls: list[int] = field(default_factory=list)
    """Indices of the calls whose outputs it holds, in order."""
    finish_reason: str = "stop"
    """The last output's finish reason."""
    start_call: int = 0
    """Index of the call this sequence was opened for."""
    reason: str = "start"
    """Why this sequence began: ``start``, ``compaction`` (agents), ``drift`` (the proxy's split)."""

    @property
    def num_generated(self) -> int:
        """Trainable tokens so far (``loss_mask`` 1)."""
        return sum(self.loss_mask)

    def extends(self, prompt_ids: Sequence[int]) -> bool:
        """Whether ``prompt_ids`` starts with every token of this sequence."""
        n = len(self.tokens)
        return len(prompt_ids) >= n and list(prompt_ids[:n]) == self.tokens

    def add_context(self, ids: Sequence[int]) -> None:
        """Append ids nobody generated for this sample: mask 0, logprob 0.0, no version."""
        self.tokens += [int(t) for t in ids]
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.weight_versions += [CONTEXT_VERSION] * len(ids)

    def add_output(self, call: CallTokens) -> None:
        """Append ``call``'s output: trainable with its logprobs and versions, or context when not ``trainable``."""
        n = len(call.output_ids)
        if len(call.output_logprobs) != n:
            raise ValueError(f"logprobs: {len(call.output_logprobs)} values for {n} generated tokens")
        if len(call.output_weight_versions) != n:
            raise ValueError(f"weight_versions: {len(call.output_weight_versions)} values for {n} generated tokens")
        if call.trainable:
            self.tokens += [int(t) for t in call.output_ids]
            self.logprobs += [float(x) for x in call.output_logprobs]
            self.loss_mask += [1] * n
            self.weight_versions += [int(v) for v in call.output_weight_versions]
        else:
            self.add_context(call.output_ids)
        self.calls.append(call.index)
        self.finish_reason = call.finish_reason

    def add_call(self, call: CallTokens) -> None:
        """Append ``call``: its prompt past this sequence's tokens (context), then its output.

        Raises ``ValueError`` when the prompt does not extend the sequence (``extends``)."""
        if not self.extends(call.prompt_ids):
            raise ValueError(f"call {call.index}: its prompt does not extend the sequence's {len(self.tokens)} tokens")
        self.add_context(call.prompt_ids[len(self.tokens) :])
        self.add_output(call)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens."""
        del self.tokens[n:], self.logprobs[n:], self.loss_mask[n:], self.weight_versions[n:]

    def to_sample(
        self,
        reward: float,
        *,
        max_seq_len: Optional[int] = None,
        finish_reason: Optional[str] = None,
        text: str = "",
    ) -> Optional[RolloutSample]:
        """The sample (copies of the lists), or None when no token is trainable.

        Longer than ``max_seq_len``: cut to it (the builder too) and ``finish_reason="length"``;
        else ``finish_reason`` when given, else the last output's."""
        finish = finish_reason or self.finish_reason
        if max_seq_len is not None and len(self.tokens) > max_seq_len:
            self.truncate(max_seq_len)
            finish = "length"
        if self.num_generated == 0:
            return None
        versions = [v for v, m in zip(self.weight_versions, self.loss_mask) if m]
        return RolloutSample(
            tokens=list(self.tokens),
            logprobs=list(self.logprobs),
            loss_mask=list(self.loss_mask),
            reward=reward,
            finish_reason=finish,
            text=text,
            token_weight_versions=versions if all(v >= 0 for v in versions) else None,
        )

    @classmethod
    def of_call(cls, call: CallTokens, reason: str = "start") -> "SampleBuilder":
        """A sequence opened by ``call``: its whole prompt as context, then its output."""
        builder = cls(start_call=call.index, reason=reason)
        builder.add_call(call)
        return builder
