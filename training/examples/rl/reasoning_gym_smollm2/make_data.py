"""Write ``data.jsonl`` (128 problems, seed 1) and ``eval.jsonl`` (64, seed 2) from reasoning-gym.

Each line is a row of ``training.envs.reasoning_gym_rows``: ``messages``, the library's ``entry``, ``answer``.
"""

import json
from pathlib import Path

from rollout import SYSTEM_PROMPT, dataset

from training.envs import reasoning_gym_rows

HERE = Path(__file__).parent

if __name__ == "__main__":
    for name, size, seed in (("data.jsonl", 128, 1), ("eval.jsonl", 64, 2)):
        rows = reasoning_gym_rows(dataset(size, seed), system_prompt=SYSTEM_PROMPT)
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
