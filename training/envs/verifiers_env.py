"""verifiers environments (0.2.x, the ``vf.Environment`` API) as rollouts: the library's prompts,
transitions and rubric; our sampling loop.

    make_rollout_fn = make_verifiers_rollout_fn(vf_env)
    main(cfg, rollout_fn_factory=make_rollout_fn, rows=verifiers_rows(vf_env))

``verifiers_rows(vf_env)`` gives the environment's formatted dataset rows (``prompt``, ``answer``,
``info``, ``task``, ``example_id``). Each episode drives the environment's own steps, never its
client rollout: ``init_state(row)`` and ``setup_state``, ``get_prompt_messages(state)`` for the
first prompt, then per model turn ``add_model_response(state, prompt, response)`` with the reply
our deployment generated, ``is_completed(state)`` (its stop conditions: ``max_turns``, a final
environment response...) and, while not completed, ``get_prompt_messages(state)`` again (which
calls the environment's ``env_response``); the messages it appends become the next user / tool
turn. At the end ``render_completion`` and ``rubric.score_rollout(state)`` give ``state["reward"]``
(the weighted sum) and ``state["metrics"]`` (one value per reward function).

The episode runs through ``training.agents.make_agent_rollout_fn``, like every adapter here:
``VerifiersEnvironment.reset()`` gives the environment's first prompt (the agent starts with no message
of its own) and ``reward_components()`` the rubric's parts.

Tokens: ``training.agents.TrajectoryEngine`` builds the conversation token-in/token-out, so the
sample holds exactly the server's ids and ``loss_mask`` is 1 only on the model's turns. The run's
reward is the rubric's; ``metadata["reward_components"]`` holds the per-function values.
Replies are plain text (no tool-call parsing: a ``ToolEnv`` needs the model's tool calls in its
own format, not handled here).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Optional

from training.agents import Action, ConversationAgent, Environment, StepResult, make_agent_rollout_fn
from training.utils.rl.rollout import RolloutFn, RolloutSetup

MODEL_NAME = "policy"
"""The model name recorded in the environment's state (nothing is sent under it)."""


def _library():
    try:
        import verifiers
    except ImportError as e:
        raise ImportError(
            'verifiers is not installed (scripts/setup.sh leaves it out): pip install -e ".[verifiers]"'
        ) from e
    return verifiers


def verifiers_rows(vf_env, n: int = -1, seed: int = 0) -> list[dict]:
    """The environment's formatted dataset as rows (``vf_env.get_dataset(n, seed)``)."""
    return [dict(r) for r in vf_env.get_dataset(n=n, seed=seed)]


def message_dicts(messages: list) -> list[dict]:
    """verifiers' message objects as chat-template dicts (``role``, ``content``, tool fields when set)."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        if d.get("role") == "text":
            d["role"] = "user"
        out.append(d)
    return out


def _refuse(self, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("the verifiers adapter samples through the deployment; the environment's client is unused")


class VerifiersEnvironment(Environment):
    """An agents ``Environment`` over one verifiers rollout state (single-use)."""

    def __init__(self, vf_env, task: dict):
        self.vf_env = vf_env
        self.task = task
        self.state = None
        self.prompt: list = []
        self.scored_components: dict[str, float] = {}

    async def reset(self) -> list[dict]:
        """Initialise the state; the first prompt's messages (the whole opening: the agent starts empty)."""
        vf = _library()
        client = vf.clients.Client.__new__(_client_class(vf))
        state = await self.vf_env.init_state(self.task, client=client, model=MODEL_NAME, sampling_args={})
        self.state = await self.vf_env.setup_state(state) or state
        self.prompt = list(await self.vf_env.get_prompt_messages(self.state))
        return message_dicts(self.prompt)

    async def step(self, action: Action) -> StepResult:
        vf = _library()
        response = vf.types.Response(
            id=uuid.uuid4().hex,
            created=int(time.time()),
            model=MODEL_NAME,
            message=vf.types.ResponseMessage(content=action.text, finish_reason="stop", is_truncated=False),
        )
        await self.vf_env.add_model_response(self.state, self.prompt, response)
        if await self.vf_env.is_completed(self.state):
            reward = await self._score()
            return StepResult(reward=reward, done=True, info={"final_reward": reward, "stop_reason": "finish"})
        prompt = list(await self.vf_env.get_prompt_messages(self.state))
        if await self.vf_env.is_completed(self.state):  # env_response set a final response
            reward = await self._score()
            return StepResult(reward=reward, done=True, info={"final_reward": reward, "stop_reason": "finish"})
        new = message_dicts(prompt[len(self.prompt) + 1 :])
        self.prompt = prompt
        return StepResult(observation={"messages": new}, reward=0.0, done=False)

    async def _score(self) -> float:
        await self.vf_env.render_completion(self.state)
        await self.vf_env.rubric.score_rollout(self.state)
        self.scored_components = {k: float(v) for k, v in (self.state["metrics"] or {}).items()}
        return float(self.state["reward"])

    async def truncate(self, reason: str) -> float:
        return await self._score()

    def reward_components(self) -> dict[str, float]:
        """The rubric's value per reward function (``state["metrics"]``), once scored."""
        return dict(self.scored_components)


class VerifiersAgent(ConversationAgent):
    """Plain-text turns; the environment's new messages (``observation["messages"]``) are appended as given."""

    def feedback_messages(self, result: StepResult) -> list[dict]:
        return list(result.observation.get("messages") or [])


def _client_class(vf):
    """A concrete ``vf.clients.Client`` whose every method refuses: it fills the client slot of the
    environment's state, and our loop never calls it (built once per process)."""
    global _CLIENT_CLASS
    if _CLIENT_CLASS is None:
        names = ("setup_client", "to_native_tool", "to_native_prompt", "get_native_response")
        names += ("raise_from_native_response", "from_native_response", "close")
        _CLIENT_CLASS = type("UnusedVerifiersClient", (vf.clients.Client,), {n: _refuse for n in names})
    return _CLIENT_CLASS


_CLIENT_CLASS = None


def make_verifiers_rollout_fn(
    vf_env,
    *,
    max_total_tokens: Optional[int] = None,
    chat_template_kwargs: Optional[dict] = None,
) -> Callable[[RolloutSetup], RolloutFn]:
    """A ``make_rollout_fn(setup)``: ``rollout_fn(row)`` runs one episode of ``vf_env`` on ``row`` (a row of
    ``verifiers_rows``) and returns a ``RolloutRun`` whose reward is the rubric's (its parts in
    ``metadata["reward_components"]``)."""
    _library()
    return make_agent_rollout_fn(
        agent_factory=lambda row: VerifiersAgent(None),  # the environment's reset gives the whole prompt
        env_factory=lambda row: VerifiersEnvironment(vf_env, row),
        max_total_tokens=max_total_tokens,
        chat_template_kwargs=chat_template_kwargs,
        template_check="off",
    )
