"""reasoning-gym tasks as rollouts: the library's questions in, the library's score out.

    from training.envs.reasoning_gym_env import reasoning_gym_dataset, reasoning_gym_rows, make_reasoning_gym_rollout_fn
    dataset = reasoning_gym_dataset("chain_sum", size=200, seed=1, min_terms=2, max_terms=3)
    main(cfg, rollout_fn_factory=make_reasoning_gym_rollout_fn(dataset), rows=reasoning_gym_rows(dataset))

``reasoning_gym_dataset(name, size=, seed=, **settings)`` is ``reasoning_gym.create_dataset``; a dict
``{name: weight}`` or ``{name: (weight, settings)}`` builds the library's ``composite`` dataset (its
``DatasetSpec`` list). ``reasoning_gym_rows`` gives one row per entry: ``messages`` (a system prompt
and the question as the user message), the library's ``entry`` (question, answer, metadata) and
``answer``. The rollout renders ``messages`` with the model's chat template, samples through the
deployment token-in/token-out (``training.agents.TrajectoryEngine``: the sample's tokens are
exactly the server's ids, ``loss_mask`` 1 only on generated ids) and scores the reply with
``dataset.score_answer(answer_fn(reply), entry)``, the library's own scorer (``answer_fn`` defaults to
reasoning-gym's ``extract_answer``: the text inside ``<answer>...</answer>``, None when absent).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Union

from training.agents import ModelAgent, TaskEnvironment, make_agent_rollout_fn

DEFAULT_SYSTEM_PROMPT = "default"
"""The name of a system prompt in reasoning-gym's ``SYSTEM_PROMPTS`` (asks for ``<answer>...</answer>``)."""


def _library():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError('reasoning-gym is not installed: pip install -e ".[envs]"') from e
    return reasoning_gym


def reasoning_gym_dataset(
    name: Union[str, dict[str, Any]], *, size: int = 500, seed: Optional[int] = None, **settings: Any
):
    """The library's dataset: ``create_dataset(name, size=, seed=, **settings)``.

    ``name`` as a dict builds a composite: ``{"chain_sum": 2.0, "basic_arithmetic": (1.0, {"max_terms": 2})}``
    (each value a weight, or ``(weight, settings)``); ``settings`` must then be empty."""
    rg = _library()
    if isinstance(name, str):
        return rg.create_dataset(name, size=size, seed=seed, **settings)
    if not isinstance(name, dict) or not name:
        raise ValueError(f"name: a dataset name or a non-empty dict {{name: weight}}, got {name!r}")
    if settings:
        raise ValueError(f"settings {sorted(settings)}: give each dataset's settings in the dict as (weight, settings)")
    from reasoning_gym.composite import DatasetSpec

    specs = []
    for key, value in name.items():
        weight, config = value if isinstance(value, (tuple, list)) else (value, {})
        if not isinstance(weight, (int, float)) or weight <= 0:
            raise ValueError(f"name[{key!r}]: the weight must be a number > 0, got {weight!r}")
        specs.append(DatasetSpec(name=key, weight=float(weight), config=dict(config)))
    return rg.create_dataset("composite", size=size, seed=seed, datasets=specs)


def system_prompt_text(system_prompt: Optional[str]) -> Optional[str]:
    """A name from reasoning-gym's ``SYSTEM_PROMPTS`` becomes its text; other strings are used as given."""
    if system_prompt is None:
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(system_prompt, system_prompt)


def reasoning_gym_rows(dataset, system_prompt: Optional[str] = DEFAULT_SYSTEM_PROMPT) -> list[dict]:
    """One row per entry: ``{"messages": [system?, user: question], "entry": entry, "answer": entry["answer"]}``."""
    system = system_prompt_text(system_prompt)
    rows = []
    for entry in dataset:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": entry["question"]})
        rows.append({"messages": messages, "entry": entry, "answer": entry["answer"]})
    return rows


def default_answer_fn(reply: str) -> Optional[str]:
    """reasoning-gym's ``extract_answer``: the text of the last ``<answer>`` block, None when there is none."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(reply)


def last_number_answer_fn(reply: str) -> Optional[str]:
    """The reply's last integer (``"... = 12. Answer: 12"`` → ``"12"``), None when it has none.

    For small models that do not write ``<answer>`` tags (SmolLM2-135M almost never does) on tasks
    whose answer is one integer; the library still scores the extracted text."""
    numbers = re.findall(r"-?\d+", reply.replace(",", ""))
    return numbers[-1] if numbers else None


def reasoning_gym_scorer(dataset, answer_fn: Callable[[str], Optional[str]] = default_answer_fn):
    """``reward_fn(reply, row) -> dataset.score_answer(answer_fn(reply), row["entry"])`` (the library's score)."""

    def reward_fn(reply: str, row: dict) -> float:
        if "entry" not in row:
            raise KeyError("row: no 'entry' (build rows with reasoning_gym_rows)")
        return float(dataset.score_answer(answer_fn(reply), row["entry"]))

    return reward_fn


def make_reasoning_gym_rollout_fn(
    dataset,
    *,
    answer_fn: Callable[[str], Optional[str]] = default_answer_fn,
    max_total_tokens: Optional[int] = None,
    chat_template_kwargs: Optional[dict] = None,
    template_check: str = "off",
):
    """A ``make_rollout_fn(setup)`` for rows of ``reasoning_gym_rows(dataset)``: one turn, the library's score.

    The result is a ``RolloutRun`` whose ``metadata`` holds the transcript (``messages``, ``turns``,
    ``final_reward``...). ``template_check`` is off: a single turn needs no multi-turn template."""
    reward_fn = reasoning_gym_scorer(dataset, answer_fn)
    return make_agent_rollout_fn(
        agent_factory=lambda row: ModelAgent(row["messages"]),
        env_factory=lambda row: TaskEnvironment(row, reward_fn),
        max_total_tokens=max_total_tokens,
        chat_template_kwargs=chat_template_kwargs,
        template_check=template_check,
    )
