"""``EpisodeFacts``: the typed record of one agent episode's facts, serialised as ``RolloutRun.metadata``.

Both agent paths fill one: the in-process agents (``training/agents/trajectory.py``) and the proxy
(``training/proxy/rollout.py``); per-call credit adds its part (``TransitionResult.to_run`` in
``training/utils/rl/credit.py``), the proxy's stitching its own (``StitchResult.to_run``).
``to_metadata()`` gives the dict the run carries, written to ``rollouts.jsonl``: one key per field that
is set (a field left None is absent), the field's name as the key except ``episode_return``, written
``return``. ``training/utils/rl/run_metrics.py`` turns the documented keys (``AGENT_KEYS``) into step
metrics; every other key is for the log.

Fields are grouped by who sets them: both producers (the step metrics' keys, the mode, the return),
per-call credit (``transitions`` mode; ``intermediate_rewards`` and ``run_reward`` also in the proxy's
stitch mode), the agents' transcript, the proxy's record.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

RETURN_KEY = "return"
"""The metadata key of ``EpisodeFacts.episode_return`` (``return`` is a Python keyword)."""


@dataclass
class EpisodeFacts:
    """What is known about one episode, beside its samples (module docstring)."""

    # ---- both producers ----------------------------------------------------------------------
    mode: Optional[str] = None
    """How the episode became training data: ``stitch`` (segments) or ``transitions`` (one sample per call)."""
    stop_reason: Optional[str] = None
    """Why the episode ended, one of ``STOP_REASONS`` (the proxy's episodes always ``finish``: a failed one returns
    no run and counts as a failure cause)."""
    session_id: Optional[str] = None
    """The proxy: the session the calls were recorded under."""
    episode_return: Optional[float] = None
    """``return``: the episode's return as its source reports it. Agents: the sum of the environment's step
    rewards (the final reward plus the intermediate ones). The proxy: ``reward_fn``'s score; the per-call
    rewards (credit, posted rewards) come on top of it (``run_reward`` in stitch mode)."""
    calls: Optional[list[dict]] = None
    """The proxy: every call of the session, as ``CallRecord.summary()`` (label, reason, weight version...)."""
    num_calls: Optional[int] = None
    """Model calls of the episode (the proxy: of the trained agents)."""
    labels: Optional[dict[str, int]] = None
    """``{"NEW": n, "APPEND": n, "WIPE": n}``: how the calls relate (agents: the first call, token-in turns,
    compactions; the proxy: turn matching)."""
    drift: Optional[int] = None
    """Calls whose messages extend the previous call but whose re-rendered tokens do not (agents: 0, never
    re-rendered)."""
    tool_status_counts: Optional[dict[str, int]] = None
    """``{status: n}`` over the episode's tool calls (``ok``, ``error``, ``timeout``, ..., ``unparsable``)."""
    truncated: Optional[bool] = None
    """A length limit cut the episode (agents) or a call (the proxy)."""
    weight_versions: Optional[list[int]] = None
    """The proxy: the distinct weight versions of the calls, sorted."""

    # ---- the agents' transcript -----------------------------------------------------------------
    final_reward: Optional[float] = None
    """Agents: R, the environment's score of the answer (the return without the intermediate rewards)."""
    finish_reason: Optional[str] = None
    """Agents: the sampler's finish reason of the last call (``length`` when the episode was cut)."""
    num_turns: Optional[int] = None
    """Agents: turns of the episode (one model call each)."""
    wall_s: Optional[float] = None
    """Agents: seconds the episode took."""
    turns: Optional[list[dict]] = None
    """Agents: per turn, its tokens, finish reason, weight version, timings, tool statuses and rewards."""
    segments: Optional[list[dict]] = None
    """Agents: per segment, ``start_turn``, ``reason`` (``start`` / ``compaction``), ``tokens``, ``generated``."""
    messages: Optional[list[dict]] = None
    """Agents: the conversation at the end of the episode."""

    # ---- the proxy's stitching -----------------------------------------------------------------
    segment_calls: Optional[list[list[int]]] = None
    """Per stitched sample, the indices of the calls whose outputs it trains on."""
    drift_events: Optional[list[dict]] = None
    """One entry per re-render drift: call index, break position, what was done."""
    dropped_segments: Optional[int] = None
    """Segments with no trainable token left (empty outputs, or cut by ``max_seq_len``)."""

    # ---- per-call credit ----------------------------------------------------------------------
    sample_calls: Optional[list[int]] = None
    """``transitions``: the call index of each sample."""
    credited_rewards: Optional[list[float]] = None
    """``transitions``: each sample's reward g·R + i."""
    sample_weights: Optional[list[float]] = None
    """``transitions``: each sample's weight, ``1 / n``."""
    return_weights: Optional[list[float]] = None
    """``transitions``: g of each sample, its share of the return."""
    intermediate_rewards: Optional[list[float]] = None
    """Per-call rewards i (tool status, rewards the agent posted): per call (agents' stitch mode, the proxy's
    stitch mode), per sample (``transitions``)."""
    run_reward: Optional[float] = None
    """The run's reward (``RolloutRun.reward``): R in ``transitions``; R + sum(i) in the proxy's stitch mode."""

    # ---- environments --------------------------------------------------------------------------
    reward_components: Optional[dict[str, float]] = None
    """The final reward's parts by name (``Environment.reward_components()``, e.g. a verifiers rubric's)."""

    def to_metadata(self) -> dict[str, Any]:
        """The ``RolloutRun.metadata`` dict: every set field under its key (module docstring)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[RETURN_KEY if f.name == "episode_return" else f.name] = value
        return out

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every metadata key a record can write."""
        return tuple(RETURN_KEY if f.name == "episode_return" else f.name for f in fields(cls))
