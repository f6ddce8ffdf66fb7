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
adds its output as context (mask 0, logprob 0.0) instead.

The segments are built by the one sample builder (``training/utils/rl/rollout/sample_builder.py``,
shared with the in-process agents): its mask, logprob and weight-version conventions.

Over-length: a segment longer than ``max_seq_len`` is cut to it (``finish_reason="length"``);
a segment with no trainable token left is dropped. Invariant (tested): the mask-1 tokens of a
segment, in order, are the output ids of its calls (their kept prefix where cut), and their
logprobs are the sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from training.proxy.records import CallRecord
from training.utils.rl.rollout import RolloutRun, RolloutSample
from training.utils.rl.rollout.episode_facts import EpisodeFacts
from training.utils.rl.rollout.sample_builder import SampleBuilder
from training.utils.rl.rollout.turn_matching import common_prefix_len

DRIFT_POLICIES = ("split", "mask")


@dataclass
class StitchResult:
    samples: list[RolloutSample]
    segment_calls: list[list[int]]
    """For each sample, the indices of the calls whose outputs it trains on."""
    drift_events: list[dict]
    """One entry per re-render drift: call index, break position, what was done."""
    dropped_segments: int = 0
    """Segments with no trainable token left (empty outputs, or cut by ``max_seq_len``)."""

    def to_run(self, run_reward: float, facts: EpisodeFacts, intermediate: list[float]) -> Optional[RolloutRun]:
        """The ``RolloutRun`` of the segments (reward ``run_reward``), or None when none is left; its metadata
        is ``facts`` with the stitching's part: ``mode``, ``segment_calls``, ``drift_events``,
        ``dropped_segments``, ``intermediate_rewards`` (per call) and ``run_reward``."""
        facts = replace(
            facts,
            mode="stitch",
            segment_calls=self.segment_calls,
            drift_events=self.drift_events,
            dropped_segments=self.dropped_segments,
            intermediate_rewards=list(intermediate),
            run_reward=run_reward,
        )
        if not self.samples:
            return None
        return RolloutRun(segments=self.samples, reward=run_reward, metadata=facts.to_metadata())


def stitch_calls(
    calls: list[CallRecord], *, reward: float = 0.0, on_drift: str = "split", max_seq_len: Optional[int] = None
) -> StitchResult:
    """Segments of ``calls`` (already labelled; any agent filter applied by the caller), each built by a
    ``SampleBuilder`` (``training/utils/rl/rollout/sample_builder.py``: its masks and weight versions)."""
    if on_drift not in DRIFT_POLICIES:
        raise ValueError(f"on_drift: {on_drift!r} is not one of {DRIFT_POLICIES}")
    chains: dict[int, list[CallRecord]] = {}
    for c in calls:
        if c.label is None:
            raise ValueError(f"calls[{c.index}]: unlabelled call; record calls through the proxy")
        chains.setdefault(c.label.chain, []).append(c)
    builders: list[SampleBuilder] = []
    drift: list[dict] = []
    for chain in chains.values():
        seg: Optional[SampleBuilder] = None
        for record in chain:
            call = record.call_tokens()
            if seg is not None:
                if seg.extends(call.prompt_ids):
                    seg.add_call(call)
                    continue
                p = common_prefix_len(seg.tokens, call.prompt_ids)
                drift.append({"call": call.index, "position": p, "expected_len": len(seg.tokens), "action": on_drift})
                if on_drift == "mask":
                    seg.truncate(p)
                    seg.add_call(call)
                    continue
                builders.append(seg)
            seg = SampleBuilder.of_call(call, reason="start" if seg is None else "drift")
        if seg is not None:
            builders.append(seg)
    result = StitchResult([], [], drift)
    for b in builders:
        sample = b.to_sample(reward, max_seq_len=max_seq_len)
        if sample is None:
            result.dropped_segments += 1
            continue
        result.samples.append(sample)
        result.segment_calls.append(b.calls)
    return result
