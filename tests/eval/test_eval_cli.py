"""``python -m training.eval`` as a user runs it: a subprocess on the tiny model, its embedded server, a jsonl and a
reward function. The report has the documented keys, pass@k never falls as k grows, one seed gives one set of
numbers in two processes, a model compared with itself (and a checkpoint with the weights it holds) differs
nowhere, and a bad argument is one line with exit code 2."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"prompt": "1 + 1 =", "id": "a"}, {"prompt": "Hello", "id": "b"}, {"prompt": "The cat", "id": "c"}]
REWARD = "def score(completion, row):\n    return float(len(completion) % 3 == 0)\n"
SUMMARY_KEYS = {"prompts", "samples", "failed", "reward_mean", "reward_ci_low", "reward_ci_high", "ci_level"}


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("task")
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "reward.py").write_text(REWARD)
    return {"data": str(folder / "rows.jsonl"), "reward": f"{folder / 'reward.py'}:score"}


def run_eval(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "training.eval", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def sampled(task: dict, out: Path) -> list[str]:
    return ["--data", task["data"], "--reward", task["reward"], "--n", "4", "--max-tokens", "8", "--out", str(out)]


@pytest.fixture(scope="module")
def first_report(tiny_model_path, task, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("first")
    done = run_eval(tiny_model_path, *sampled(task, out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pass@4" in done.stdout and "reward_mean [95% CI]" in done.stdout  # the console table
    return json.loads((out / "eval.json").read_text()), out


def test_report_has_the_documented_keys_and_csv(first_report):
    report, out = first_report
    assert {"model", "task", "settings", "summary", "prompts"} <= set(report)
    assert SUMMARY_KEYS | {"pass@1", "pass@2", "pass@4"} == set(report["summary"])
    assert report["summary"]["prompts"] == 3 and report["summary"]["samples"] == 12
    assert report["settings"]["k"] == [1, 2, 4] and report["settings"]["seed"] == 0
    assert [p["id"] for p in report["prompts"]] == ["a", "b", "c"]
    assert all(len(p["rewards"]) == 4 for p in report["prompts"])
    with (out / "eval.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert [line["id"] for line in lines] == ["a", "b", "c"]
    assert set(lines[0]) == {"index", "id", "samples", "passed", "reward_mean"}
    s = report["summary"]
    assert s["reward_ci_low"] <= s["reward_mean"] <= s["reward_ci_high"]


def test_pass_at_k_never_falls_as_k_grows(first_report):
    s = first_report[0]["summary"]
    assert s["pass@1"] <= s["pass@2"] <= s["pass@4"]
    assert s["pass@1"] == pytest.approx(sum(p["passed"] for p in first_report[0]["prompts"]) / 12)


def test_compare_with_itself_differs_nowhere_and_repeats_the_seeded_numbers(
    tiny_model_path, task, first_report, tmp_path
):
    done = run_eval(tiny_model_path, *sampled(task, tmp_path), "--compare", tiny_model_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["summary"] == first_report[0]["summary"]  # the same seed in another process: the same numbers
    assert [p["rewards"] for p in report["prompts"]] == [p["rewards"] for p in first_report[0]["prompts"]]
    diff = report["compare"]["difference"]
    assert diff["reward_mean_difference"] == 0.0 and diff["prompts_differing"] == 0
    assert diff["per_prompt_difference"] == [0.0, 0.0, 0.0]
    assert report["compare"]["summary"] == report["summary"]
    with (tmp_path / "eval.csv").open() as f:
        assert all(float(line["difference"]) == 0.0 for line in csv.DictReader(f))


def test_a_checkpoint_step_serves_the_weights_it_holds(tiny_model_path, tiny_teacher_path, task, tmp_path):
    """A fake run whose step-1 checkpoint holds the teacher's weights: ``--run RUN --step 1`` equals the teacher."""
    from safetensors.torch import load_file

    from training.trainer import PolicyTrainer
    from training.utils.checkpoint import save_checkpoint
    from training.utils.config import TrainerConfig

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"base_model": tiny_model_path, "trainer": {"device": "cpu"}}))
    trainer = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu"))
    teacher = load_file(str(Path(tiny_teacher_path) / "model.safetensors"))
    missing, _ = trainer.model.load_state_dict(teacher, strict=False)
    assert not [m for m in missing if "lm_head" not in m]  # a tied head is the only name the file may omit
    save_checkpoint(run / "checkpoints", 1, trainer.model, trainer.optimizer, {"step": 1})
    out = tmp_path / "out"
    done = run_eval("--run", str(run), "--step", "1", *sampled(task, out), "--compare", tiny_teacher_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["model"]["step"] == 1 and report["model"]["run"] == str(run)
    assert report["compare"]["difference"]["prompts_differing"] == 0
    assert not (out / "weights-a").exists()  # the exported checkpoint is removed after the run


@pytest.mark.parametrize(
    "args, says",
    [
        (["/no/such/model", "--data", "{data}"], "MODEL: no folder /no/such/model"),
        (["{model}", "--data", "/no/such.jsonl"], "--data: no such file /no/such.jsonl"),
        (["{model}", "--data", "{data}", "--reward", "no_such_module:score"], "--reward: cannot import module"),
        (["{model}", "--data", "{data}", "--reward", "{reward_file}:nothing"], "has no 'nothing'"),
        (["{model}", "--data", "{data}", "--reward", "score"], "--reward: give module:function or path.py:function"),
        (["{model}", "--data", "{data}", "--n", "2", "--k", "4"], "--k: each k must be in [1, n=2]"),
        (["{model}", "--run", "{model}", "--data", "{data}"], "MODEL, --run: give one"),
        (["{model}", "--data", "{data}", "--n", "abc"], "argument --n: invalid int value"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_code_2(tiny_model_path, task, args, says, capsys):
    """In this process (each refusal comes before any model loads); the subprocess test below checks the exit."""
    from training.eval.cli import main

    fill = {"model": tiny_model_path, "data": task["data"], "reward_file": task["reward"].rpartition(":")[0]}
    try:
        code = main([a.format(**fill) for a in args])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("python -m training.eval: ") and says in lines[0]


def test_a_missing_file_ends_the_process_with_one_line_and_exit_code_2(tiny_model_path, task):
    done = run_eval(tiny_model_path, "--data", "/no/such.jsonl", "--reward", task["reward"], timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "python -m training.eval: --data: no such file /no/such.jsonl; give a .jsonl file (one JSON object per line)"
    ]


def test_a_reasoning_gym_task_is_scored_by_the_library(tiny_model_path, tmp_path):
    pytest.importorskip("reasoning_gym")
    done = run_eval(
        tiny_model_path, "--reasoning-gym", "chain_sum", "--size", "2", "--n", "2", "--max-tokens", "8",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["task"]["kind"] == "reasoning_gym" and report["summary"]["samples"] == 4
    assert report["summary"]["failed"] == 0
