"""Gym-style text environments as multi-turn rollouts, token-in/token-out.

    make_rollout_fn = make_text_gym_rollout_fn(lambda row: GuessNumber(row["target"]), max_steps=6)

The environment is any object with ``reset()`` returning an observation (or gymnasium's
``(observation, info)``) and ``step(action)`` returning ``(observation, reward, done, info)`` or
gymnasium's ``(observation, reward, terminated, truncated, info)``; either method may be async.
Observations and actions are text. One episode: the first observation is the user message (after an
optional system prompt); each model reply is passed to ``step`` as the action (the reply text as
generated, stripped); each new observation comes back as a user message; the episode ends when
``done`` (or ``terminated`` / ``truncated``) is true or after ``max_steps`` actions.

The episode runs through ``training.agents.make_agent_rollout_fn``, like every adapter here:
``TextGymEnvironment.reset()`` gives the first observation as the opening user message.

Tokens: ``training.agents.TrajectoryEngine`` builds the conversation, so turn k+1's prompt is turn
k's prompt + the server's generated ids + the template glue of the new user message: the sample's
tokens are exactly what the server saw and produced, ``loss_mask`` is 1 only on the model's turns.
The return is the sum of the step rewards (the last step's reward is the run's ``final_reward``;
the earlier ones are its ``intermediate_rewards``). ``metadata["stop_reason"]`` is ``finish`` when
the environment ended the episode (``terminated`` or a 4-tuple ``done``), ``max_steps`` when gymnasium's
``truncated`` or this adapter's ``max_steps`` cut it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from training.agents import Action, ConversationAgent, Environment, StepResult, make_agent_rollout_fn
from training.utils.rl.rollout import RolloutFn, RolloutSetup

EMPTY_OBSERVATION = "(no observation)"
"""The user message sent for an empty observation (a chat turn cannot be empty)."""


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def observation_text(obs: Any) -> str:
    """The observation as a user message: a string as is, anything else through ``str``."""
    text = obs if isinstance(obs, str) else str(obs)
    return text if text.strip() else EMPTY_OBSERVATION


async def reset_observation(env: Any) -> tuple[str, dict]:
    """``env.reset()`` as ``(text, info)``; accepts a bare observation or gymnasium's ``(obs, info)``."""
    if not callable(getattr(env, "reset", None)) or not callable(getattr(env, "step", None)):
        raise TypeError(f"env: {type(env).__name__} needs reset() and step(action) methods")
    out = await _maybe_await(env.reset())
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return observation_text(out[0]), dict(out[1])
    return observation_text(out), {}


def unpack_step(out: Any) -> tuple[Any, float, bool, bool, dict]:
    """``(obs, reward, terminated, truncated, info)`` from a 4-tuple or gymnasium's 5-tuple."""
    if not isinstance(out, tuple) or len(out) not in (4, 5):
        raise ValueError(
            "env.step: expected (observation, reward, done, info) or "
            f"(observation, reward, terminated, truncated, info), got {type(out).__name__} {out!r:.200}"
        )
    if len(out) == 4:
        obs, reward, done, info = out
        terminated, truncated = bool(done), False
    else:
        obs, reward, terminated, truncated, info = out
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise ValueError(f"env.step: the reward {reward!r} is not a number") from None
    return obs, reward, bool(terminated), bool(truncated), dict(info or {})


class TextGymEnvironment(Environment):
    """An ``Environment`` over a gym-style text environment (single-use: one episode)."""

    def __init__(self, env: Any, task: Optional[dict] = None, *, max_steps: Optional[int] = None):
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps: must be >= 1 or None, got {max_steps}")
        self.env = env
        self.task = task or {}
        self.max_steps = max_steps
        self.num_steps = 0
        self.infos: list[dict] = []
        """Each step's ``info`` (for logs and tests)."""

    async def reset(self) -> list[dict]:
        """The first observation, as the opening user message."""
        text, info = await reset_observation(self.env)
        self.infos.append(info)
        return [{"role": "user", "content": text}]

    async def step(self, action: Action) -> StepResult:
        self.num_steps += 1
        obs, reward, terminated, truncated, info = unpack_step(await _maybe_await(self.env.step(action.text)))
        self.infos.append(info)
        at_limit = self.max_steps is not None and self.num_steps >= self.max_steps
        done = terminated or truncated or at_limit
        stop = "finish" if terminated else "max_steps"
        return StepResult(
            observation={} if done else {"text": observation_text(obs)},
            reward=reward,
            done=done,
            info={"stop_reason": stop, "final_reward": reward} if done else {},
        )


def make_text_gym_rollout_fn(
    env_factory: Callable[[dict], Any],
    *,
    system_prompt: Optional[str] = None,
    max_steps: Optional[int] = None,
    max_total_tokens: Optional[int] = None,
    chat_template_kwargs: Optional[dict] = None,
    template_check: str = "warn",
) -> Callable[[RolloutSetup], RolloutFn]:
    """A ``make_rollout_fn(setup)``: ``rollout_fn(row)`` runs one episode of ``env_factory(row)`` and returns
    a ``RolloutRun`` (the transcript in ``metadata``), or None when nothing was generated.

    ``template_check`` (``warn`` / ``error`` / ``off``) checks once that the chat template only appends
    when a conversation grows (``training/openai_api/template_check.py``)."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else None
    return make_agent_rollout_fn(
        agent_factory=lambda row: ConversationAgent(system),  # the first observation comes from reset
        env_factory=lambda row: TextGymEnvironment(env_factory(row), row, max_steps=max_steps),
        max_total_tokens=max_total_tokens,
        chat_template_kwargs=chat_template_kwargs,
        template_check=template_check,
    )
