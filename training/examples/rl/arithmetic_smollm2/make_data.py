"""Write data.jsonl (training rows) and eval.jsonl (held-out rows): one-digit word problems.

``python make_data.py`` rewrites both files; the seed makes them reproducible. Each row is
``{"question": str, "answer": str}``; no eval question appears in the training rows.
"""

import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Li", "Sam", "Tom", "Maya"]
THINGS = ["apples", "coins", "books", "stamps", "marbles"]


def problem(rng: random.Random) -> dict:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    if rng.random() < 0.5:
        return {
            "question": f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
            "answer": str(a + b),
        }
    a, b = max(a, b), min(a, b)
    return {
        "question": f"{name} has {a} {thing} and gives away {b}. How many {thing} does {name} have left?",
        "answer": str(a - b),
    }


def main(num_train: int = 500, num_eval: int = 100, seed: int = 0) -> None:
    rng = random.Random(seed)
    eval_rows = {}
    while len(eval_rows) < num_eval:
        row = problem(rng)
        eval_rows[row["question"]] = row
    train_rows = []
    while len(train_rows) < num_train:
        row = problem(rng)
        if row["question"] not in eval_rows:
            train_rows.append(row)
    here = Path(__file__).parent
    for name, rows in [("data.jsonl", train_rows), ("eval.jsonl", list(eval_rows.values()))]:
        (here / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
