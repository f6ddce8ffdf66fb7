"""Black-box agent: train ``agent.solve`` (plain OpenAI SDK code) without changing a line of it.

Each rollout gives the agent a fresh session URL on the training proxy; the proxy forwards to
the deployment, records every call's exact tokens and labels it NEW / APPEND / WIPE; the
episode becomes stitched segments (mask 1 exactly on the tokens the server generated).
Reward: 1.0 when the reply's first number equals the row's ``answer``, 0.1 for a reply with
some other number, else 0.0.
"""

import logging
import re

from agent import solve

from training.proxy import make_proxy_rollout_fn

MODE = "stitch"
"""``stitch`` (one sample per unbroken chain of calls) or ``transitions`` (one sample per call)."""


def parse_number(text: str) -> float | None:
    m = re.search(r"-?\d[\d,]*(?:\.\d+)?", text or "")
    return float(m.group(0).replace(",", "")) if m else None


def run_agent(row: dict, endpoint) -> str:
    """Adapter: hand the unmodified agent the session's base URL and key."""
    return solve(row["question"], base_url=endpoint.base_url, api_key=endpoint.api_key, model=endpoint.model)


def reward_fn(row: dict, answer: str) -> float:
    value = parse_number(answer)
    if value is None:
        return 0.0
    return 1.0 if abs(value - float(row["answer"])) < 1e-6 else 0.1


make_rollout_fn = make_proxy_rollout_fn(run_agent, reward_fn=reward_fn, mode=MODE)
logging.getLogger("httpx").setLevel(logging.WARNING)  # the SDK logs every request at INFO
logging.getLogger("httpx2").setLevel(logging.WARNING)
