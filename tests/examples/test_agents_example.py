"""The tool_calculator example: its tools, its reward, and ``python train.py`` for 2 steps."""

import asyncio
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.agents import ToolCall, ToolManager

EXAMPLE = Path(__file__).resolve().parents[2] / "training" / "examples" / "rl" / "tool_calculator"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    tools = importlib.import_module("calculator_tools")
    rollout = importlib.import_module("rollout")
    yield tools, rollout
    for name in ("calculator_tools", "rollout"):
        sys.modules.pop(name, None)


def test_calculator_is_safe_and_exact(example):
    tools, _ = example
    assert tools.evaluate("17 + 25 * 3") == 92 and tools.evaluate("(7 - 10) / 2") == -1.5
    assert tools.evaluate("2 ** 10") == 1024 and tools.evaluate("9 / 3") == 3
    for bad in ("__import__('os').system('true')", "x + 1", "2 ** 1000", "len('a')", "", "1 +", "9" * 300):
        with pytest.raises(ValueError):
            tools.evaluate(bad)


def test_example_tools_through_the_manager(example):
    tools, rollout = example
    manager = ToolManager([tools.CalculatorTool(), tools.PriceLookupTool()], timeout_s=2.0)
    calls = [
        ToolCall("a", "calculator", {"expression": "3 * 12"}),
        ToolCall("b", "lookup_price", {"item": "Pencils"}),
        ToolCall("c", "lookup_price", {"item": "car"}),
        ToolCall("d", "calculator", {"expression": "1/0"}),
        ToolCall("e", "calculator", {"expression": "open('f')"}),
    ]
    results = asyncio.run(manager.execute_all(calls))
    assert [(r.status, r.output) for r in results[:2]] == [("ok", "36"), ("ok", "2")]
    assert results[2].status == "error" and "known items: apple" in results[2].output
    assert results[3].status == "error" and "ZeroDivisionError" in results[3].output
    assert results[4].status == "error" and "unsupported syntax: Call" in results[4].output
    assert rollout.reward_fn("The total is 1,024 coins", {"answer": "1024"}) == 1.0
    assert rollout.reward_fn("", {"answer": "3"}) == 0.0 and rollout.reward_fn("4", {"answer": "3"}) == 0.0


def test_data_answers_match_the_tools(example):
    tools, _ = example
    for line in (EXAMPLE / "data.jsonl").read_text().splitlines():
        row = json.loads(line)
        q = row["messages"][0]["content"]
        if "Look up the price" in q:
            k, item = q.split(" do ")[1].split(" cost")[0].split(" ", 1)
            assert int(row["answer"]) == int(k) * tools.PRICES[item.rstrip("s")]


@pytest.mark.usefixtures("tiny_model_path")  # the example's process trains the tiny model
def test_example_trains_two_steps_through_async_rl_loop(tmp_path):
    log = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            f"log_path={log}",
            "max_steps=2",
            "eval_interval=0",
            "prompt_groups_per_step=2",
            "completions_per_prompt=2",
        ],
        cwd=EXAMPLE,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in trained] == [0, 1]
    assert all(m["rollout/errors"] == 0 and m["rollout/invalid"] == 0 for m in trained)
    rollouts = [json.loads(line) for line in (log / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and all(
        r["metadata"]["turns"] and r["metadata"]["messages"][0]["role"] == "system" for r in rollouts
    )
