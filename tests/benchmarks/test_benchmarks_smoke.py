"""Smoke test of the benchmark harness (benchmarks are not tests; this only checks the harness works).

Runs the cheapest figures with ``--quick`` and checks their one JSON line; renders a report; profiles a few
decode steps of the tiny model.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(name: str, *args: str, timeout: float = 120) -> str:
    """Run ``python -m benchmarks.<name> <args>`` from the repository root; its stdout, once it exited 0."""
    out = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("figure", ["engine_throughput", "sampling_cost", "decode_roofline"])
@pytest.mark.usefixtures("tiny_model_path")  # the benchmark's process runs the tiny model
def test_quick_benchmark_prints_one_parsable_json_line_with_a_ratio(figure):
    stdout = run_benchmark(figure, "--quick")
    json_lines = [l for l in stdout.splitlines() if l.startswith("{")]
    assert len(json_lines) == 1
    result = json.loads(json_lines[0])
    assert result["figure"] == figure
    assert isinstance(result["ratio"], float) and result["ratio"] > 0
    assert {"cores", "gpu", "torch"} <= set(result["machine"])
    assert result["repeats"] >= 3
    for row in result["rows"]:
        assert row["value"] > 0 and row["baseline_value"] > 0
        assert abs(row["ratio"] - row["value"] / row["baseline_value"]) <= 0.01 * row["ratio"]


@pytest.mark.vllm
def test_engine_throughput_measures_its_vllm_baseline():
    """The vLLM side of the engine benchmarks (``--quick`` skips it): one SmolLM2 row against vLLM's CPU build."""
    stdout = run_benchmark(
        "engine_throughput",
        *("--models", "smollm2", "--concurrency", "2", "--dtypes", "float32"),
        *("--sequential-requests", "1", "--repeats", "1", "--vllm", "yes"),
        timeout=900,
    )
    result = json.loads([l for l in stdout.splitlines() if l.startswith("{")][-1])
    vllm_rows = [r for r in result["rows"] if r["baseline"] == "vLLM CPU build, same requests"]
    assert len(vllm_rows) == 1 and vllm_rows[0]["baseline_value"] > 0


def test_report_flags_a_figure_worse_than_its_baseline():
    from benchmarks.report import render

    rows = [
        {"name": "fast", "value": 2.0, "unit": "tok/s", "baseline": "b", "baseline_value": 1.0, "ratio": 2.0},
        {"name": "slow", "value": 0.5, "unit": "tok/s", "baseline": "b", "baseline_value": 1.0, "ratio": 0.5},
        {
            "name": "slower sync",
            "value": 3.0,
            "unit": "s / step (lower is better)",
            "baseline": "b",
            "baseline_value": 1.0,
            "ratio": 3.0,
        },
    ]
    md = render(
        {
            "date": "d",
            "command": "python -m benchmarks.run_all",
            "total_s": 1,
            "results": [
                {"figure": "engine_throughput", "rows": rows, "machine": {"cores": 2}, "repeats": 3, "seconds": 1.0},
                {"figure": "exactness", "error": "timed out"},
            ],
        }
    )
    assert "| fast | 2 | tok/s | b | 1 | 2 |" in md
    assert "| slow | 0.5 | tok/s | b | 1 | 0.5 **(worse)** |" in md
    assert "3 **(worse)**" in md
    assert "Worse than its baseline:** slow vs b" in md
    assert "Not measured in this run:** timed out" in md


def test_rerunning_one_figure_keeps_the_others():
    from benchmarks.run_all import merge_results

    old = {
        "date": "d0",
        "command": "c",
        "total_s": 9,
        "results": [
            {"figure": "async_overlap", "rows": [1]},
            {"figure": "async_agentic", "rows": [2]},
            {"figure": "exactness", "rows": [3]},
        ],
    }
    new = {"date": "d1", "results": [{"figure": "async_agentic", "rows": [4]}]}
    merged = merge_results(old, new)
    assert [r["figure"] for r in merged["results"]] == ["async_overlap", "async_agentic", "exactness"]
    assert [r["rows"] for r in merged["results"]] == [[1], [4], [3]]
    assert merged["date"] == "d0" and merged["results"][1]["date"] == "d1"


def test_the_whole_run_keeps_the_saved_opt_in_figures_it_does_not_run():
    from benchmarks.run_all import with_saved

    old = {
        "date": "d0",
        "results": [
            {"figure": "exactness", "rows": [1]},
            {"figure": "end_to_end", "rows": [2], "date": "d-1"},
            {"figure": "distillation", "rows": [3]},
        ],
    }
    new = {"date": "d1", "results": [{"figure": "exactness", "rows": [4], "date": "d1"}]}
    saved = with_saved(old, new, whole_run=True)
    assert [(r["figure"], r["rows"], r["date"]) for r in saved["results"]] == [
        ("exactness", [4], "d1"),
        ("end_to_end", [2], "d-1"),
        ("distillation", [3], "d0"),
    ]
    assert saved["date"] == "d1"


def test_vllm_available_answers_whether_the_cpu_venv_exists():
    from benchmarks.engine_throughput import vllm_available
    from training.deployment.backends.vllm import VLLM_VENV_PYTHON

    assert vllm_available() is VLLM_VENV_PYTHON.exists()


# ---------------------------------------------------------------- end_to_end (ours vs TRL)
HARNESS_FIELDS = {
    "base_model",
    "log_path",
    "max_steps",
    "seed",
    "trainer",
    "shuffle_rows",
    "eval_rows",
    "eval_interval",
    "export_final_model",
    "dcp_save_interval",
}


def test_end_to_end_harness_changes_only_what_a_benchmark_must_fix_in_the_example_config(tmp_path):
    from benchmarks.end_to_end import example_config, harness_overrides

    shipped, _ = example_config([])
    fixed, _ = example_config(harness_overrides("tiny", 3, 7, str(tmp_path)))
    a, b = shipped.to_dict(), fixed.to_dict()
    assert {k for k in a if a[k] != b[k]} <= HARNESS_FIELDS
    assert {k for k in a["trainer"] if a["trainer"][k] != b["trainer"][k]} == {"seed"}
    assert (fixed.max_steps, fixed.seed, fixed.trainer.seed, fixed.shuffle_rows) == (3, 7, 7, False)


def test_trl_settings_follow_our_config_and_refuse_what_trl_cannot_mirror(tmp_path):
    import pytest

    from benchmarks.end_to_end import example_config, harness_overrides, micro_batch_samples, trl_settings

    base = harness_overrides("tiny", 2, 0, str(tmp_path))
    cfg, _ = example_config(base + ["trainer.learning_rate=3e-5", "temperature=0.9", "trainer.adam_betas=[0.8,0.9]"])
    s = trl_settings(cfg, longest_prompt=70)
    assert (s["learning_rate"], s["temperature"], s["adam_betas"]) == (3e-5, 0.9, [0.8, 0.9])
    assert s["prompt_groups_per_step"] * s["completions_per_prompt"] % s["micro_batch_samples"] == 0
    assert s["micro_batch_samples"] * (70 + cfg.max_tokens) <= cfg.trainer.micro_batch_tokens
    assert micro_batch_samples(32, 2000, 1024) == 1
    for override, field in [
        ("loss.policy_loss=gspo", "loss.policy_loss"),
        ("ppo_mini_batches=2", "ppo_mini_batches"),
        ("loss.aggregation=sum", "loss.aggregation"),
        ("advantage=rloo", "advantage"),
        ("loss.mis_level=token", "loss.mis_level"),
        ("trainer.warmup_steps=2", "trainer.lr_schedule"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            trl_settings(example_config(base + [override])[0], longest_prompt=70)


def test_trl_script_prompts_and_reward_are_the_example_rollouts(embedded_server, tiny_model_path, monkeypatch):
    """The example's rollout_fn, against a real server on the tiny model: the prompt ids it sends are what
    TRL's chat-template path and the harness's evaluation make, and its reward is trl_grpo.reward of the text."""
    import asyncio

    from transformers import AutoTokenizer

    from benchmarks import trl_grpo
    from benchmarks.end_to_end import chat_prompts, example_config
    from training.deployment.client import DeploymentSampler
    from training.utils.rl.rollout import RolloutSetup

    _, rollout = example_config([])
    rows = [json.loads(l) for l in (ROOT / "training/examples/rl/arithmetic_smollm2/data.jsonl").open()][:3]
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    sent = []
    real = DeploymentSampler.sample_with_prompt_tokens

    async def recording(self, prompt_ids, n=1, **kw):
        sent.append(list(prompt_ids))
        return await real(self, prompt_ids, n, **kw)

    monkeypatch.setattr(DeploymentSampler, "sample_with_prompt_tokens", recording)
    dep = embedded_server(max_model_len=256)

    async def go():
        sampler = DeploymentSampler(dep.base_url)
        setup = RolloutSetup(sampler=sampler, tokenizer=tok, sampling_kwargs={"max_tokens": 8, "temperature": 1.0})
        try:
            fn = rollout.make_rollout_fn(setup)
            return [await fn(r) for r in rows]
        finally:
            await sampler.close()

    samples = asyncio.run(go())
    trl_ids = [
        tok.apply_chat_template(
            [trl_grpo.prompt_messages(r["question"])], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"][0]
        for r in rows
    ]
    assert sent == trl_ids == chat_prompts(tok, rows, rollout.INSTRUCTION)
    assert trl_grpo.INSTRUCTION == rollout.INSTRUCTION
    assert [s.reward for s in samples] == [trl_grpo.reward(s.text, r["answer"]) for s, r in zip(samples, rows)]
    for text, answer in [
        ("So 3 + 4 = 7. Answer: 7", "7"),
        ("Answer: 1,000", "1000"),
        ("left: -2", "-2"),
        ("7 apples, answer 8", "7"),
        ("no number", "0"),
        ("", "0"),
        ("12.5", "5"),
    ]:
        expected = 1.0 if rollout.final_number(text) == answer else 0.0
        assert trl_grpo.reward(text, answer) == expected
        assert trl_grpo.arithmetic_reward([[{"role": "assistant", "content": text}]], [answer]) == [expected]


def test_end_to_end_figures_are_medians_of_the_steps_after_the_first_and_skip_accuracy_when_not_scored():
    from benchmarks.end_to_end import figure_rows

    ours = {"step_s": [9.0, 2.0, 4.0], "tokens": [100.0, 100.0, 200.0], "accuracy": 0.5}
    trl = {"step_s": [9.0, 4.0, 4.0], "tokens": [100.0, 100.0, 100.0], "accuracy": 0.25}
    rows = figure_rows({"ours": [ours], "TRL GRPOTrainer": [trl]}, 3, [0], base_accuracy=0.2)
    by = {(r["name"], r["unit"].split(" (")[0]): r for r in rows}
    assert by[("ours (3 steps)", "s / step")]["value"] == 3.0 and by[("ours (3 steps)", "s / step")]["ratio"] == 0.75
    assert by[("ours (3 steps)", "trained tok/s")]["value"] == 50.0  # median of 100/2 and 200/4
    assert by[("ours (3 steps)", "held-out accuracy")]["ratio"] == 2.0
    unscored = figure_rows(
        {"ours": [{**ours, "accuracy": None}], "TRL GRPOTrainer": [{**trl, "accuracy": None}]},
        3,
        [0],
        base_accuracy=None,
    )
    assert {r["unit"].split(" (")[0] for r in unscored} == {"s / step", "trained tok/s"}


def test_end_to_end_refuses_an_unknown_side_and_names_the_script_a_missing_venv_needs(tmp_path):
    import subprocess
    import sys

    import pytest

    from benchmarks.end_to_end import ROOT, TRL_SIDES, TrlSide, figure_rows, require_venv

    with pytest.raises(FileNotFoundError, match="run bash scripts/setup_x.sh"):
        require_venv(TrlSide("X", tmp_path / "bin" / "python", "generate", "scripts/setup_x.sh"))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.end_to_end", "--sides", "ours,trl-vlm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode != 0 and "--sides: unknown ['trl-vlm']" in out.stderr
    run = {"step_s": [9.0, 4.0], "tokens": [100.0, 100.0], "accuracy": None}
    vllm_only = figure_rows({"ours": [run], TRL_SIDES["trl-vllm"].label: [run]}, 2, [0], base_accuracy=None)
    assert {r["baseline"] for r in vllm_only} == {TRL_SIDES["trl-vllm"].label}  # TRL's generate not run
    both = figure_rows({label: [run] for label in ["ours", *(s.label for s in TRL_SIDES.values())]}, 2, [0], None)
    assert {r["baseline"] for r in both} == {"TRL GRPOTrainer"}


@pytest.mark.usefixtures("tiny_model_path")  # the benchmark's process trains the tiny model
def test_end_to_end_quick_trains_ours_with_a_variant_and_scores_each_final_model():
    """--set reaches every run of ours, --variant only its own; the notes carry the command and the --note."""
    stdout = run_benchmark(
        "end_to_end",
        *["--quick", "--sides", "ours", "--set", "completions_per_prompt=2"],
        *["--variant", "lr x10", "trainer.learning_rate=1e-4", "--note", "Shared machine."],
        timeout=300,
    )
    result = json.loads([l for l in stdout.splitlines() if l.startswith("{")][-1])
    assert result["figure"] == "end_to_end"
    runs = result["runs"]
    ours = "ours, example with completions_per_prompt=2"
    assert set(runs) == {ours, "lr x10"}
    default, variant = runs[ours][0], runs["lr x10"][0]
    assert (
        default["config"]["trainer"]["learning_rate"] == 1e-5 and variant["config"]["trainer"]["learning_rate"] == 1e-4
    )
    for run in (default, variant):
        assert len(run["step_s"]) == len(run["tokens"]) == 1 and run["step_s"][0] > 0 and run["tokens"][0] > 0
        assert 0.0 <= run["accuracy"] <= 1.0
        assert run["config"]["shuffle_rows"] is False and run["config"]["max_steps"] == 1
        assert run["config"]["completions_per_prompt"] == 2  # --quick's 4, then --set
    units = {r["unit"].split(" (")[0] for r in result["rows"]}
    assert units == {"s / step", "trained tok/s", "held-out accuracy"}
    assert all(r["baseline"] == ours for r in result["rows"])  # no TRL run: ours is the baseline
    assert result["notes"].startswith("Shared machine. tiny, 1 steps per run")
    assert "`python -m benchmarks.end_to_end --quick --sides ours --set completions_per_prompt=2" in result["notes"]


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.usefixtures("tiny_model_path")  # the profiler's process runs the tiny model
def test_profile_decode_prints_where_a_step_goes(kernel):
    from tests.deployment.engine.test_engine import require_native

    if kernel == "native":
        require_native()
    stdout = run_benchmark(
        "profile_decode",
        "--model",
        "tiny",
        "--kernel",
        kernel,
        "--batch",
        "4",
        "--context",
        "24",
        "--group",
        "2",
        "--steps",
        "3",
    )
    assert f"{kernel} step:" in stdout
    assert ("| attention |" in stdout) == (kernel == "native")


@pytest.mark.slow
def test_distillation_benchmark_quick_runs_both_sides_and_stops_them_at_the_budget(tmp_path):
    """``benchmarks/distillation.py --quick`` (tiny student and teacher): both sides run, are stopped once their
    training wall time passes the budget, and report a curve that starts at the same eval before training."""
    stdout = run_benchmark("distillation", "--quick", "--work-dir", str(tmp_path), timeout=900)
    result = json.loads([l for l in stdout.splitlines() if l.startswith("{")][-1])
    assert result["figure"] == "distillation"
    runs = result["runs"]
    assert set(runs) == {"RL (arithmetic_smollm2)", "distillation (distillation_smollm2)"}
    for (r,) in runs.values():
        assert r["stopped_at_budget"] and r["steps"] >= 1
        assert r["curve"][0][0] == 0.0 and all(t <= 15.0 for t, _, _ in r["curve"])
    assert runs["distillation (distillation_smollm2)"][0]["teacher_s"] > 0
    assert (
        runs["RL (arithmetic_smollm2)"][0]["curve"][0][1]
        == runs["distillation (distillation_smollm2)"][0]["curve"][0][1]
    )
