"""The black-box agent example trains through async_rl_loop as a user runs it, agent untouched."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "training" / "examples" / "rl" / "black_box_agent"


def test_agent_file_imports_nothing_from_the_library():
    tree = ast.parse((EXAMPLE / "agent.py").read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert "openai" in modules and not any(m.split(".")[0] == "training" for m in modules if m)


@pytest.mark.usefixtures("tiny_model_path")  # the example's process trains the tiny model
def test_black_box_example_trains_two_steps(tmp_path):
    log = tmp_path / "run"
    cmd = [sys.executable, "train.py", f"log_path={log}", "max_steps=2", "eval_interval=0", "prompt_groups_per_step=2"]
    proc = subprocess.run(cmd, cwd=EXAMPLE, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in trained] == [0, 1]
    assert all(m["rollout/errors"] == 0 and m["rollout/invalid"] == 0 and m["rollout/samples"] >= 8 for m in trained)
    rollouts = [json.loads(x) for x in (log / "rollouts.jsonl").read_text().splitlines()]
    episodes = {r["metadata"]["session_id"]: r["metadata"]["calls"] for r in rollouts}
    assert len(episodes) >= 8
    assert all(calls[0]["label"] == "NEW" and calls[0]["agent"] == "default" for calls in episodes.values())
    assert all(r["metadata"]["mode"] == "stitch" for r in rollouts)


def test_proxy_readme_snippet_runs(monkeypatch):
    """The README's python block builds a rollout factory (exec'd with the example folder importable)."""
    import re

    readme = (EXAMPLE.parents[2] / "proxy" / "README.md").read_text()
    [block] = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    namespace = {"__name__": "docs_snippet"}
    try:
        exec(compile(block, "training/proxy/README.md", "exec"), namespace)
    finally:
        sys.modules.pop("agent", None)
    assert callable(namespace["make_rollout_fn"])
    assert namespace["reward_fn"]({"answer": "5"}, " 5 ") == 1.0


@pytest.mark.slow
def test_black_box_agent_round_trips_tools_on_smollm2(tmp_path, monkeypatch):
    """The unmodified agent on SmolLM2 (greedy): a call, its tool result and the next call all pass the proxy."""
    import asyncio

    from training.deployment.backends.embedded import EmbeddedDeployment
    from training.models import resolve_model
    from training.proxy import ProxyServer
    from training.utils import DeployConfig, EngineConfig

    monkeypatch.syspath_prepend(str(EXAMPLE))
    from agent import solve

    sys.modules.pop("agent", None)
    questions = ["What is 17 * 23?", "What is 412 + 389?", "What is 96 - 48?", "What is 31 * 29?"]
    path = resolve_model("smollm2")
    cfg = DeployConfig(engine_config=EngineConfig(max_model_len=1024, max_batch_size=4))  # tools in the prompt

    async def go(base_url):
        async with ProxyServer([base_url], forced_params={"temperature": 0.0, "max_tokens": 64}) as proxy:

            async def one(i, q):
                await asyncio.to_thread(solve, q, base_url=proxy.session_url(f"s{i}"), api_key=proxy.api_key or "x")
                return proxy.close_session(f"s{i}")

            return await asyncio.gather(*(one(i, q) for i, q in enumerate(questions)))

    with EmbeddedDeployment(path, cfg, log_file=str(tmp_path / "server.log")) as dep:
        sessions = asyncio.run(go(dep.base_url))
    assert all(not s.upstream_errors for s in sessions)
    after_tool = [c for s in sessions for c in s.calls if c.messages and c.messages[-1]["role"] == "tool"]
    # a request carrying a tool result was served (no 400)
    assert after_tool, [(c.response_message, c.finish_reason) for s in sessions for c in s.calls]
    assert all(c.label.kind == "APPEND" for c in after_tool)  # and stitched onto the call that made the tool call
