"""Train an unmodified agent: an OpenAI-compatible proxy that records every call's exact tokens.

See README.md. Entry point for recipes: ``make_proxy_rollout_fn``.
"""

from training.utils.rl.rollout.turn_matching import classify, message_hash
from training.proxy.records import APPEND, NEW, WIPE, CallRecord, SessionRecord, TurnLabel
from training.proxy.rollout import AgentEndpoint, AgentFailedError, UpstreamFailedError, make_proxy_rollout_fn
from training.proxy.server import AGENT_HEADER, SESSION_HEADER, ProxyServer
from training.proxy.stitching import stitch_calls
from training.proxy.transitions import (
    build_transitions,
    discounted,
    episode_weights,
    same_return,
    tool_status_rewards,
    with_tool_status,
)
from training.proxy.upstream import UpstreamError, UpstreamPool, affinity_index

__all__ = [
    "APPEND",
    "NEW",
    "WIPE",
    "AGENT_HEADER",
    "SESSION_HEADER",
    "AgentEndpoint",
    "AgentFailedError",
    "CallRecord",
    "ProxyServer",
    "SessionRecord",
    "TurnLabel",
    "UpstreamError",
    "UpstreamFailedError",
    "UpstreamPool",
    "affinity_index",
    "build_transitions",
    "classify",
    "discounted",
    "episode_weights",
    "make_proxy_rollout_fn",
    "message_hash",
    "same_return",
    "stitch_calls",
    "tool_status_rewards",
    "with_tool_status",
]
