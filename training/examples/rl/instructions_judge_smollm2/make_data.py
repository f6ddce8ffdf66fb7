"""Write data.jsonl (training rows) and eval.jsonl (held-out rows): a short question and one checkable instruction.

``python make_data.py`` rewrites both files; the seed makes them reproducible. Each row is
``{"question": str, "constraint": {"kind": str, "arg": ...}, "prompt": str}`` (``prompt``: the question and the
instruction, what the policy and the judge read). No held-out prompt appears among the training rows.
"""

import json
import random
from pathlib import Path

from constraints import KINDS, instruction

TOPICS = ["the ocean", "a cat", "rain", "the moon", "a forest", "bread", "a city", "winter", "music", "a river",
          "the sun", "a garden", "snow", "a library", "coffee", "a mountain", "the wind", "a train", "an apple",
          "a bicycle", "the night sky", "a dog", "summer", "a bridge"]  # fmt: skip
QUESTIONS = ["Describe {t}.", "What do you like about {t}?", "Write one sentence about {t}.", "Tell me about {t}.",
             "What is special about {t}?"]  # fmt: skip
KEYWORDS = ["blue", "happy", "small", "bright", "quiet", "green", "old", "warm"]


def row(rng: random.Random) -> dict:
    question = rng.choice(QUESTIONS).format(t=rng.choice(TOPICS))
    kind = rng.choice(KINDS)
    arg = rng.randint(3, 8) if kind == "max_words" else rng.choice(KEYWORDS) if kind == "keyword" else None
    constraint = {"kind": kind, "arg": arg}
    return {"question": question, "constraint": constraint, "prompt": f"{question} {instruction(constraint)}"}


def main(num_train: int = 400, num_eval: int = 64, seed: int = 0) -> None:
    rng = random.Random(seed)
    eval_rows: dict[str, dict] = {}
    while len(eval_rows) < num_eval:
        r = row(rng)
        eval_rows[r["prompt"]] = r
    train_rows = []
    while len(train_rows) < num_train:
        r = row(rng)
        if r["prompt"] not in eval_rows:
            train_rows.append(r)
    here = Path(__file__).parent
    for name, rows in [("data.jsonl", train_rows), ("eval.jsonl", list(eval_rows.values()))]:
        (here / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
