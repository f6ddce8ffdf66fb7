"""Each example pair runs end to end as a user runs it: ``python train.py`` in its folder."""

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "training" / "examples" / "rl"


def run_example(name: str, log_path: Path, *overrides: str, timeout: int = 600) -> list[dict]:
    cmd = [sys.executable, "train.py", f"log_path={log_path}", *overrides]
    proc = subprocess.run(cmd, cwd=EXAMPLES / name, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "name, extra",
    [
        ("single_turn_token_in", ()),
        ("multi_turn_message_in", ()),
        ("arithmetic_smollm2", ("base_model=tiny", "completions_per_prompt=2", "dynamic_filter_fn=null")),
        ("tool_use_smollm2", ("base_model=tiny", "completions_per_prompt=2")),
        pytest.param(
            "reasoning_gym_smollm2",
            ("base_model=tiny", "completions_per_prompt=2"),
            marks=pytest.mark.skipif(not find_spec("reasoning_gym"), reason="the [envs] extra is not installed"),
        ),
        ("text_gym_guess", ()),
        pytest.param(
            "verifiers_local",
            (),
            marks=pytest.mark.skipif(not find_spec("verifiers"), reason="verifiers is not installed (heavy extra)"),
        ),
    ],
)
@pytest.mark.usefixtures("tiny_model_path")  # the example's process trains the tiny model
def test_example_pair_runs(name, extra, tmp_path):
    metrics = run_example(name, tmp_path / "run", "max_steps=2", "eval_interval=0", "prompt_groups_per_step=2", *extra)
    trained = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in trained] == [0, 1]
    assert all(m["rollout/errors"] == 0 and m["rollout/invalid"] == 0 for m in trained)
    assert (tmp_path / "run" / "final" / "config.json").exists()


def test_distillation_example_runs_on_the_tiny_models(tiny_teacher_path, tmp_path):
    """The distillation pair with a tiny student and a tiny teacher (same tokenizer, other weights)."""
    metrics = run_example(
        "distillation_smollm2",
        tmp_path / "run",
        "max_steps=2",
        "eval_interval=0",
        "prompt_groups_per_step=2",
        "completions_per_prompt=2",
        "base_model=tiny",
        f"distillation.teacher_model={tiny_teacher_path}",
    )
    trained = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in trained] == [0, 1]
    assert all(m["distill/scored_tokens"] > 0 and m["rollout/errors"] == 0 for m in trained)
    assert (tmp_path / "run" / "teacher.log").exists() and (tmp_path / "run" / "final" / "config.json").exists()


def test_distillation_example_without_its_teacher_says_what_to_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", f"distillation.teacher_model={tmp_path / 'absent'}"],
        cwd=EXAMPLES / "distillation_smollm2",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1 and "run the arithmetic example first" in proc.stderr


def test_help_lists_config_fields():
    proc = subprocess.run(
        [sys.executable, "train.py", "--help"],
        cwd=EXAMPLES / "single_turn_token_in",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        proc.returncode == 0 and "max_head_offpolicy_versions" in proc.stdout and "trainer.learning_rate" in proc.stdout
    )


@pytest.mark.slow
def test_default_example_reward_rises(tmp_path):
    """The default example, as shipped: the last steps' mean reward is clearly above the first steps'."""
    metrics = [m for m in run_example("single_turn_token_in", tmp_path / "run", timeout=1800) if "train/loss" in m]
    first = sum(m["rollout/reward_mean"] for m in metrics[:10]) / 10
    last = sum(m["rollout/reward_mean"] for m in metrics[-10:]) / 10
    assert last > first + 0.1, (first, last)


@pytest.mark.demo
def test_tool_use_smollm2_demo_improves_held_out_accuracy(tmp_path):
    """The tool-use demo as shipped (SmolLM2, ~4 min on 2 idle cores): held-out accuracy rises."""
    metrics = run_example("tool_use_smollm2", tmp_path / "run", timeout=3600)
    evals = [m["eval/pass_rate"] for m in metrics if "eval/pass_rate" in m]
    assert len(evals) == 2 and evals[-1] >= evals[0] + 0.1, evals
    trained = [m for m in metrics if "train/loss" in m]
    assert sum(m["rollout/errors"] for m in trained) == 0


def test_tool_use_calculator_schema_and_refusals(monkeypatch):
    """The demo's tool: schema from the signature and docstring; anything but integer arithmetic is refused."""
    import asyncio
    import importlib

    from training.agents import ToolCall

    monkeypatch.syspath_prepend(str(EXAMPLES / "tool_use_smollm2"))
    sys.modules.pop("rollout", None)
    rollout = importlib.import_module("rollout")
    try:
        tool = rollout.TOOLS.tools["calculator"]
        assert tool.parameters["required"] == ["expression"]
        assert tool.parameters["properties"]["expression"]["type"] == "string"
        assert "parentheses" in tool.parameters["properties"]["expression"]["description"]
        calls = [
            ToolCall("a", "calculator", {"expression": "12 * (3 + 4)"}),
            ToolCall("b", "calculator", {"expression": "__import__('os').getcwd()"}),
            ToolCall("c", "calculator", {"expression": "2 ** 400"}),
            ToolCall("d", "calculator", {"value": 3}),
        ]
        results = asyncio.run(rollout.TOOLS.execute_all(calls))
        assert [r.status for r in results] == ["ok", "error", "error", "bad_arguments"]
        assert results[0].output == "84"
        assert rollout.reward_fn("The answer is 1,767.", {"answer": "1767"}) == 1.0
        assert rollout.reward_fn("1766", {"answer": "1767"}) == 0.0
    finally:
        sys.modules.pop("rollout", None)


def test_multi_turn_mask_is_exactly_the_generated_tokens(embedded_server, tiny_model_path, monkeypatch):
    """Every token with mask 1 is a token the server generated, in order; every turn's prompt is a prefix."""
    import asyncio
    import importlib

    from transformers import AutoTokenizer

    from training.deployment.client import DeploymentSampler
    from training.utils.rl.rollout import RolloutSetup, validate_sample

    monkeypatch.syspath_prepend(str(EXAMPLES / "multi_turn_message_in"))
    rollout = importlib.import_module("rollout")
    calls = []

    real = DeploymentSampler.sample_with_prompt_tokens

    async def recording(self, prompt_ids, n=1, **kw):
        out = await real(self, prompt_ids, n, **kw)
        calls.append((list(prompt_ids), out[0]))
        return out

    monkeypatch.setattr(DeploymentSampler, "sample_with_prompt_tokens", recording)

    row = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}
    dep = embedded_server()

    async def go():
        sampler = DeploymentSampler(dep.base_url)
        setup = RolloutSetup(
            sampler=sampler,
            tokenizer=AutoTokenizer.from_pretrained(tiny_model_path),
            sampling_kwargs={"max_tokens": 6, "temperature": 1.0, "stop": [" ", "e"]},
        )
        try:
            return [await rollout.make_rollout_fn(setup)(row) for _ in range(4)]
        finally:
            await sampler.close()

    samples = asyncio.run(go())
    assert len(calls) > 4  # at least one episode took several turns
    first_prompt = calls[0][0]
    episodes = []  # calls split where an episode starts again from the row's first prompt
    for prompt, completion in calls:
        if prompt == first_prompt:
            episodes.append([])
        assert prompt[: len(first_prompt)] == first_prompt
        episodes[-1].append((prompt, completion))
    assert len(episodes) == len(samples) == 4
    for s, turns in zip(samples, episodes):
        validate_sample(s)
        for prompt, _ in turns:
            assert s.tokens[: len(prompt)] == prompt  # every turn's prompt is a prefix of the sample
        generated = [t for t, m in zip(s.tokens, s.loss_mask) if m == 1]
        assert generated == [t for _, c in turns for t in c.output_tokens]
        assert s.token_weight_versions == [v for _, c in turns for v in c.token_weight_versions]
        assert [lp for lp, m in zip(s.logprobs, s.loss_mask) if m == 1] == [
            lp for _, c in turns for lp in c.inference_logprobs
        ]
    rollout_mod = sys.modules.pop("rollout")
    sys.modules.pop("reward", None)
    assert rollout_mod is rollout


@pytest.mark.parametrize("name", sorted(p.parent.name for p in EXAMPLES.glob("*/train.py")))
def test_importing_train_py_reads_no_command_line_and_loads_no_model(name, tmp_path):
    """tinker's rule: only ``python train.py`` parses argv; an import (a test, a sweep script) is inert."""
    code = (
        "import sys; sys.argv = ['x', 'not_a_field=1']; import train; "
        "assert train.cfg.base_model in ('tiny', 'smollm2'); "
        "loaded = [m for m in sys.modules if m.startswith(('training.trainer', 'training.deployment.engine'))]; "
        "assert not loaded, loaded"
    )
    env = {**__import__("os").environ, "TRAINING_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=EXAMPLES / name, capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (tmp_path / "cache").exists()  # no model was built or converted


@pytest.mark.parametrize("name", sorted(p.parent.name for p in EXAMPLES.glob("*/train.py")))
def test_help_and_a_mistyped_key_answer_without_importing_torch(name):
    """``--help`` and a bad ``key=value`` are answered before torch (seconds to import) is loaded."""
    code = (
        "import runpy, sys\n"
        "for argv in (['--help'], ['trainer.learnig_rate=1']):\n"
        "    sys.argv = ['train.py', *argv]\n"
        "    try:\n"
        "        runpy.run_path('train.py', run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        print('exit:', e.code)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'training.trainer') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=EXAMPLES / name, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exit: 0" in proc.stdout and "trainer.lr_schedule=" in proc.stdout
    assert "did you mean trainer.learning_rate?" in proc.stdout
