"""Agents inside the normal recipe: ``make_agent_rollout_fn`` -> a ``make_rollout_fn(setup)``.

    from training.agents import make_agent_rollout_fn
    make_rollout_fn = make_agent_rollout_fn(agent_factory=lambda row: ToolAgent(row["messages"]),
                                            env_factory=lambda row: ToolEnvironment(row, tools, reward_fn))
    main(cfg, rollout_fn_factory=make_rollout_fn, rows=...)

Each ``rollout_fn(row)`` builds a fresh agent and environment, runs one episode with a
``TrajectoryEngine`` on the recipe's sampler and returns a ``RolloutRun`` (with the transcript
in ``metadata``, written to ``rollouts.jsonl``), or a plain ``RolloutSample`` when
``as_run=False`` and the episode has one segment. An episode that generated nothing returns None.

``mode="transitions"`` (the proxy's name for it) trains per call instead: each model call of the
episode is its own sample (exact prompt ids masked, the call's output ids trainable), rewarded
``g_k·R + i_k`` (``credit_fn(turns, R)``, default the same return; i_k adds the call's intermediate
reward from tool status), weight ``1 / n``; see ``trajectory.py`` and ``training/utils/rl/credit.py``.

Before the first rollout the template check runs on the policy's tokenizer
(``training/openai_api/template_check.py``, with ``chat_template_kwargs``): ``template_check="warn"``
logs a template that drifts or cannot render a tool conversation, ``"error"`` raises, ``"off"`` skips.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from training.agents.agents import ConversationAgent
from training.agents.environments import Environment
from training.agents.trajectory import MODES, TrajectoryEngine
from training.utils.constrained_calls import checked_constrained_calls
from training.utils.rl.credit import CreditFn
from training.utils.rl.rollout import RolloutFn, RolloutResult, RolloutSetup
from training.openai_api.template_check import CHECK_MODES, run_template_check

AgentFactory = Callable[[dict], ConversationAgent]
EnvFactory = Callable[[dict], Environment]


def engine_for_setup(
    setup: RolloutSetup,
    *,
    max_total_tokens: Optional[int] = None,
    sampling: Optional[dict] = None,
    chat_template_kwargs: Optional[dict] = None,
    constrained_calls: str = "exclude",
) -> TrajectoryEngine:
    """A ``TrajectoryEngine`` on the recipe's sampler; the length limit is the smaller of ``max_total_tokens``
    and ``setup.max_seq_len``."""
    limits = [x for x in (max_total_tokens, setup.max_seq_len) if x]
    sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)
    return TrajectoryEngine(
        sampler,
        setup.tokenizer,
        max_total_tokens=min(limits) if limits else None,
        sampling=sampling,
        chat_template_kwargs=chat_template_kwargs,
        constrained_calls=constrained_calls,
    )


def make_agent_rollout_fn(
    agent_factory: AgentFactory,
    env_factory: EnvFactory,
    *,
    max_total_tokens: Optional[int] = None,
    sampling: Optional[dict[str, Any]] = None,
    chat_template_kwargs: Optional[dict] = None,
    as_run: bool = True,
    template_check: str = "warn",
    mode: str = "stitch",
    credit_fn: Optional[CreditFn] = None,
    constrained_calls: str = "exclude",
) -> Callable[[RolloutSetup], RolloutFn]:
    """A ``make_rollout_fn(setup)`` whose ``rollout_fn(row)`` runs ``agent_factory(row)`` in ``env_factory(row)``.

    ``mode``: ``stitch`` (segments, the return on each) or ``transitions`` (one sample per call,
    ``credit_fn(turns, R)`` per-call credit: ``same_return`` by default, or ``discounted(gamma)``).
    ``constrained_calls``: ``exclude`` (default) or ``train``, for calls the agent constrains
    (``ConversationAgent.tool_choice`` / ``response_format``); the proxy's switch, same meaning.
    """
    checked_constrained_calls(constrained_calls)
    if template_check not in CHECK_MODES:
        raise ValueError(f"template_check: {template_check!r} is not one of {CHECK_MODES}")
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")

    def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
        run_template_check(
            setup.tokenizer, template_check, where="make_agent_rollout_fn", **(chat_template_kwargs or {})
        )
        engine = engine_for_setup(
            setup,
            max_total_tokens=max_total_tokens,
            sampling=sampling,
            chat_template_kwargs=chat_template_kwargs,
            constrained_calls=constrained_calls,
        )

        async def rollout_fn(row: dict) -> RolloutResult:
            env = env_factory(row)
            agent = agent_factory(row)
            episode = await engine.collect(agent, env)
            return episode.to_result(as_run=as_run, mode=mode, credit_fn=credit_fn, max_seq_len=setup.max_seq_len)

        return rollout_fn

    return make_rollout_fn
