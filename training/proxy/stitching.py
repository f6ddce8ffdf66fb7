"""Stitching: turn a session's calls into ``RolloutSample`` segments with exact masks.

Per chain (the calls that share ``label.chain``), in order:

- the first call opens a segment: its prompt ids (mask 0, logprob 0.0) then its output ids
  (mask 1, the sampler's logprobs);
- a later call whose prompt starts with the segment's tokens (= previous prompt + output)
  adds the new prompt suffix as context (mask 0) and its output as trainable (mask 1);
- a later call whose prompt does not (re-render drift: messages matched, tokens did not) is
  never trained with shifted masks: ``on_drift="split"`` (default) closes the segment and
  opens a new one from this call's prompt; ``on_drift="mask"`` keeps the common token
  prefix, drops the segment's tail from the break on and continues from this call's prompt
  (the dropped tail's generated tokens are lost, the rest stays exact).

A call flagged ``trainable=False`` (constrained decoding under ``constrained_calls="exclude"``)
adds its output as context (mask 0) instead.

Over-length: a segment longer than ``max_seq_len`` is cut to it (``finish_reason="length"``);
a segment with no trainable token left is dropped. Invariant (tested): the mask-1 tokens of a
segment, in order, are the output ids of its calls (their kept prefix where cut), and their
logprobs are the sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from training.utils.rl.rollout.turn_matching import common_prefix_len
from training.proxy.records import CallRecord
from training.utils.rl.rollout import RolloutSample

DRIFT_POLICIES = ("split", "mask")


@dataclass
class SegmentBuilder:
    """Parallel token lists under construction, plus which calls they hold."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    """Parallel to ``tokens``: the weight version of a generated token, -1 on context."""
    calls: list[int] = field(default_factory=list)
    finish_reason: str = "stop"

    def add_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.weight_versions += [-1] * len(ids)

    def add_output(self, call: CallRecord) -> None:
        self.tokens += call.output_ids
        self.logprobs += call.output_logprobs
        self.loss_mask += [int(call.trainable)] * len(call.output_ids)  # an excluded constrained call: context
        self.weight_versions += call.output_weight_versions
        self.calls.append(call.index)
        self.finish_reason = call.finish_reason

    def truncate(self, n: int) -> None:
        del self.tokens[n:], self.logprobs[n:], self.loss_mask[n:], self.weight_versions[n:]

    def to_sample(self, reward: float, max_seq_len: Optional[int]) -> Optional[RolloutSample]:
        finish = self.finish_reason
        if max_seq_len is not None and len(self.tokens) > max_seq_len:
            self.truncate(max_seq_len)
            finish = "length"
        if sum(self.loss_mask) == 0:
            return None
        versions = [v for v, m in zip(self.weight_versions, self.loss_mask) if m]
        return RolloutSample(
            tokens=list(self.tokens),
            logprobs=list(self.logprobs),
            loss_mask=list(self.loss_mask),
            reward=reward,
            finish_reason=finish,
            token_weight_versions=versions if all(v >= 0 for v in versions) else None,
        )


@dataclass
class StitchResult:
    samples: list[RolloutSample]
    segment_calls: list[list[int]]
    """For each sample, the indices of the calls whose outputs it trains on."""
    drift_events: list[dict]
    """One entry per re-render drift: call index, break position, what was done."""
    dropped_segments: int = 0
    """Segments with no trainable token left (empty outputs, or cut by ``max_seq_len``)."""


def stitch_calls(
    calls: list[CallRecord], *, reward: float = 0.0, on_drift: str = "split", max_seq_len: Optional[int] = None
) -> StitchResult:
    """Segments of ``calls`` (already labelled; any agent filter applied by the caller)."""
    if on_drift not in DRIFT_POLICIES:
        raise ValueError(f"on_drift: {on_drift!r} is not one of {DRIFT_POLICIES}")
    chains: dict[int, list[CallRecord]] = {}
    for c in calls:
        if c.label is None:
            raise ValueError(f"calls[{c.index}]: unlabelled call; record calls through the proxy")
        chains.setdefault(c.label.chain, []).append(c)
    builders: list[SegmentBuilder] = []
    drift: list[dict] = []
    for chain in chains.values():
        seg: Optional[SegmentBuilder] = None
        for call in chain:
            if seg is not None:
                p = common_prefix_len(seg.tokens, call.prompt_ids)
                if p == len(seg.tokens):
                    seg.add_context(call.prompt_ids[p:])
                    seg.add_output(call)
                    continue
                drift.append({"call": call.index, "position": p, "expected_len": len(seg.tokens), "action": on_drift})
                if on_drift == "mask":
                    seg.truncate(p)
                    seg.add_context(call.prompt_ids[p:])
                    seg.add_output(call)
                    continue
                builders.append(seg)
            seg = SegmentBuilder()
            seg.add_context(call.prompt_ids)
            seg.add_output(call)
        if seg is not None:
            builders.append(seg)
    result = StitchResult([], [], drift)
    for b in builders:
        sample = b.to_sample(reward, max_seq_len)
        if sample is None:
            result.dropped_segments += 1
            continue
        result.samples.append(sample)
        result.segment_calls.append(b.calls)
    return result
