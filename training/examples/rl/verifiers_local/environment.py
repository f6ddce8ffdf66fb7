"""A verifiers environment built from local data (no hub download): ``load_environment()``.

Capital cities, two turns: after the first answer the environment asks the model to confirm it
(``vf.MultiTurnEnv.env_response``). The rubric: ``correct`` (1.0 when the last reply names the
capital, weight 1.0) and ``brief`` (1.0 for a reply of at most 5 words, weight 0.2).
"""

import verifiers as vf
from datasets import Dataset

CAPITALS = {
    "France": "Paris",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Germany": "Berlin",
    "Japan": "Tokyo",
    "Egypt": "Cairo",
    "Peru": "Lima",
    "Kenya": "Nairobi",
}
SYSTEM_PROMPT = "Answer with the city's name only."


def correct(completion, answer, **kwargs) -> float:
    return 1.0 if answer.lower() in (completion[-1].content or "").lower() else 0.0


def brief(completion, **kwargs) -> float:
    return 1.0 if len((completion[-1].content or "").split()) <= 5 else 0.0


class ConfirmEnv(vf.MultiTurnEnv):
    """Asks once to confirm the answer; the rubric scores the last reply."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Are you sure? Give the city again."}]


def load_environment() -> vf.Environment:
    data = Dataset.from_list(
        [{"question": f"What is the capital of {country}?", "answer": city} for country, city in CAPITALS.items()]
    )
    rubric = vf.Rubric(funcs=[correct, brief], weights=[1.0, 0.2])
    return ConfirmEnv(dataset=data, system_prompt=SYSTEM_PROMPT, rubric=rubric, max_turns=2)
