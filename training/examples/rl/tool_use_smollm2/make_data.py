"""Write ``data.jsonl`` (400 rows) and ``eval.jsonl`` (48 rows): arithmetic SmolLM2 gets wrong without a tool.

    python make_data.py

Each row: ``{"messages": [{"role": "user", "content": "What is 47 * 86?"}], "answer": "4042"}``.
A third each: two-digit products, three-digit sums, three-digit minus two-digit differences.
No eval question is among the training rows.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def problem(rng: random.Random) -> tuple[str, int]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        return f"{a} * {b}", a * b
    if kind == 1:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return f"{a} + {b}", a + b
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return f"{a} - {b}", a - b


def rows(n: int, rng: random.Random, exclude: set[str]) -> list[dict]:
    out, seen = [], set(exclude)
    while len(out) < n:
        expression, value = problem(rng)
        if expression in seen:
            continue
        seen.add(expression)
        out.append({"messages": [{"role": "user", "content": f"What is {expression}?"}], "answer": str(value)})
    return out


if __name__ == "__main__":
    rng = random.Random(1234)
    eval_rows = rows(48, rng, set())
    train_rows = rows(400, rng, {r["messages"][0]["content"][8:-1] for r in eval_rows})
    for name, data in (("eval.jsonl", eval_rows), ("data.jsonl", train_rows)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in data))
