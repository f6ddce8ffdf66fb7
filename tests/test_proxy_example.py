"""The black-box agent example trains through async_rl_loop as a user runs it, agent untouched."""

import ast
import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "training" / "examples" / "rl" / "black_box_agent"


def test_agent_file_imports_nothing_from_the_library():
    tree = ast.parse((EXAMPLE / "agent.py").read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "openai" in modules and not any(m.split(".")[0] == "training" for m in modules if m)


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
