"""On-policy distillation: the per-token reward, per-token advantages in the loss, the recipe with a teacher.

Real parts: the embedded server on the tiny model over loopback, a second tiny model with the same tokenizer
and other weights as the teacher (``tiny_teacher_path``), the recipe end to end.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from training.deployment.client import DeploymentSampler
from training.utils import DeployConfig, EngineConfig, LossConfig
from training.utils.config import ConfigError
from training.utils.rl.distillation import DistillationConfig, DistillationStats, distillation_advantages


def hf_logprobs(model_path: str, seq: list[int]) -> torch.Tensor:
    """The teacher's side computed directly: log p(seq[t] | seq[:t]) for t >= 1 from a transformers fp32 forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_model_len=128, max_batch_size=8)


# ---------------------------------------------------------------- the per-token reward


def test_distillation_advantage_is_the_teacher_minus_sampler_logprob_on_trainable_tokens():
    mask, sampler, teacher = [0, 0, 1, 1, 1], [0.0, 0.0, -1.0, -0.5, -2.0], [None, -3.0, -1.5, -0.25, -2.0]
    assert distillation_advantages(mask, sampler, teacher, 0.7, 1.0, 0.0) == [0.0, 0.0, -0.5, 0.25, 0.0]
    mixed = distillation_advantages(mask, sampler, teacher, [9.0, 9.0, 1.0, -1.0, 2.0], 2.0, 0.5)
    assert mixed == [0.0, 0.0, -1.0 + 0.5, 0.5 - 0.5, 0.0 + 1.0]
    unscored = [None, None, None, -1.0, -1.0]  # a trainable token without a teacher logprob
    with pytest.raises(ValueError, match="teacher_logprobs_T"):
        distillation_advantages(mask, sampler, unscored, 0.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="teacher_logprobs_T"):
        distillation_advantages(mask, sampler, teacher[:4], 0.0, 1.0, 0.0)
    stats = DistillationStats()
    stats.add(mask, sampler, teacher, [0.0, 0.0, -0.5, 0.25, 0.0])
    m = stats.metrics()
    assert m["distill/reverse_kl"] == pytest.approx((0.5 - 0.25 + 0.0) / 3)
    assert m["distill/teacher_logprob_mean"] == pytest.approx(-3.75 / 3) and m["distill/scored_tokens"] == 3


def test_distillation_config_is_checked():
    assert not DistillationConfig().enabled
    assert DistillationConfig(deployment=DeployConfig(base_url="http://127.0.0.1:9")).enabled
    for bad in ({"kl_coef": -1.0}, {"task_reward_coef": float("nan")}, {"teacher_model": ""}):
        with pytest.raises(ConfigError, match="distillation."):
            DistillationConfig(**bad)
    with pytest.raises(ConfigError, match="kl_coef"):
        DistillationConfig(teacher_model="tiny", kl_coef=0.0, task_reward_coef=0.0)


def test_distillation_defaults_the_loss_and_keeps_a_chosen_one():
    from training.recipes.config import DISTILLATION_LOSS, Config

    on = DistillationConfig(teacher_model="tiny")
    assert Config(base_model="tiny", distillation=on).loss == DISTILLATION_LOSS
    assert Config(base_model="tiny", distillation=on).policy_loss == "importance_sampling"
    assert Config(base_model="tiny").loss == LossConfig()
    chosen = Config(base_model="tiny", distillation=on, loss=LossConfig(policy_loss="grpo", kl_beta=0.0))
    assert chosen.loss.policy_loss == "grpo"
    assert Config(base_model="tiny", distillation=on, policy_loss="cispo").loss.policy_loss == "cispo"


def test_recipe_teacher_reward_equals_a_direct_teacher_forward(server, tiny_model_path, tiny_teacher_path, tmp_path):
    """The recipe's per-token advantage of real samples: kl_coef·(teacher logprob of the same ids, from a
    transformers forward of the teacher − the sampler's logprob) + task_reward_coef·Â, 0 off the mask."""
    from transformers import AutoTokenizer

    from training.recipes.config import Config
    from training.recipes.teacher import start_teacher
    from training.utils.rl.groups import PromptGroup
    from training.utils.rl.rollout import RolloutSample

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt = [5, 17, 42, 99, 7]
    cfg = Config(
        base_model=tiny_model_path,
        deployment=DeployConfig(engine_config=EngineConfig(max_model_len=128)),
        distillation=DistillationConfig(teacher_model=tiny_teacher_path, kl_coef=2.0, task_reward_coef=0.5),
    )
    sampler = DeploymentSampler(server.base_url)

    async def sample():
        try:
            return await sampler.sample_with_prompt_tokens(prompt, n=3, max_tokens=12, seed=3, ignore_eos=True)
        finally:
            await sampler.close()

    completions = asyncio.run(sample())
    group = PromptGroup(position=0, row={}, submit_version=0)
    for k, c in enumerate(completions):
        n_out = len(c.full_tokens) - c.prompt_len
        sample_ = RolloutSample(
            c.full_tokens, [0.0] * c.prompt_len + c.inference_logprobs, [0] * c.prompt_len + [1] * n_out, float(k)
        )
        group.samples.append(sample_)
        group.completion_index.append(k)
        group.completion_rewards[k] = float(k)
    group.compute_advantages()
    task = list(group.advantages)
    teacher = start_teacher(cfg, tmp_path, tokenizer, threads=1)
    try:

        async def distill():
            try:
                return await teacher.distill([group])
            finally:
                await teacher.close_sampler()

        metrics = asyncio.run(distill())
    finally:
        teacher.stop()
    assert (tmp_path / "teacher.log").exists()
    kl_sum, tokens = 0.0, 0
    for s, adv, a_task in zip(group.samples, group.advantages, task):
        direct = hf_logprobs(tiny_teacher_path, s.tokens)  # teacher logprob of token t, for t >= 1
        assert len(adv) == len(s.tokens)
        for t, (m, lp_s) in enumerate(zip(s.loss_mask, s.logprobs)):
            if not m:
                assert adv[t] == 0.0
                continue
            expected = 2.0 * (direct[t - 1].item() - lp_s) + 0.5 * a_task
            assert adv[t] == pytest.approx(expected, abs=2e-4)
            kl_sum += lp_s - direct[t - 1].item()
            tokens += 1
    assert metrics["distill/reverse_kl"] == pytest.approx(kl_sum / tokens, abs=1e-4)
    assert metrics["distill/scored_tokens"] == tokens == 36


def test_a_teacher_with_another_vocabulary_is_refused(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from training.models.build_tiny import build_tiny
    from training.recipes.config import Config
    from training.recipes.teacher import start_teacher

    other = build_tiny(tmp_path / "other", seed=5)  # its tokenizer is trained on another corpus
    cfg = Config(base_model=tiny_model_path, distillation=DistillationConfig(teacher_model=str(other)))
    with pytest.raises(ValueError, match="distillation.teacher_model: .* another vocabulary"):
        start_teacher(cfg, tmp_path, AutoTokenizer.from_pretrained(tiny_model_path), threads=1)


def test_a_teacher_server_that_cannot_start_stops_the_run_with_one_line(tiny_model_path, tmp_path, monkeypatch):
    """A teacher folder given relative to the working directory, without its weights: the run ends with one
    line naming the server's error and its log (not a traceback), and leaves no server behind."""
    import shutil

    from training.recipes.async_rl_loop import main
    from training.recipes.config import Config

    broken = tmp_path / "teachers" / "no_weights"
    shutil.copytree(tiny_model_path, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    monkeypatch.chdir(tmp_path)
    cfg = Config(
        base_model="tiny",
        log_path=str(tmp_path / "run"),
        completions_per_prompt=2,
        prompt_groups_per_step=1,
        max_steps=1,
        max_tokens=4,
        deployment=DeployConfig(engine_config=EngineConfig(max_model_len=128, max_batch_size=4)),
        distillation=DistillationConfig(teacher_model="teachers/no_weights"),
    )
    with pytest.raises(SystemExit) as e:
        main(cfg, rows=[{"prompt": "1 plus 1?", "answer": "2"}])
    message = str(e.value.code)
    assert "\n" not in message and message.startswith("run stopped: the embedded server exited during startup")
    assert "Error" in message and str(tmp_path / "run" / "teacher.log") in message
    log = (tmp_path / "run" / "teacher.log").read_text()
    assert str(broken) in log, "the server was given the absolute folder"


# ---------------------------------------------------------------- the recipe


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["async_rl_loop", "rl_loop"])
def test_recipe_distils_for_two_steps_and_resumes(tiny_teacher_path, tmp_path, loop):
    """Distillation on in both recipes: the teacher's server starts and stops with the run, the ``distill/*`` and
    ``perf/teacher_s`` metrics are logged, the loss is −distill/advantage_mean (per-token advantages reached it);
    a resumed run starts its teacher again and trains the next step."""
    import importlib

    from training.recipes.config import Config

    recipe = importlib.import_module(f"training.recipes.{loop}")
    rows = [{"prompt": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(12)]

    def cfg(steps: int) -> Config:
        return Config(
            base_model="tiny",
            log_path=str(tmp_path / "run"),
            completions_per_prompt=2,
            prompt_groups_per_step=2,
            max_steps=steps,
            max_tokens=8,
            max_head_offpolicy_versions=1,
            dcp_save_interval=1,
            if_log_path_exists="resume",
            deployment=DeployConfig(engine_config=EngineConfig(max_model_len=128, max_batch_size=8)),
            distillation=DistillationConfig(teacher_model=tiny_teacher_path),
        )

    first = recipe.main(cfg(2), rows=rows)
    assert first["steps"] == 2
    second = recipe.main(cfg(3), rows=rows)
    assert second["steps"] == 3
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in trained] == [0, 1, 2]
    for m in trained:
        assert m["distill/scored_tokens"] > 0 and m["perf/teacher_s"] > 0
        assert math.isfinite(m["distill/reverse_kl"]) and m["distill/teacher_logprob_mean"] < 0
        assert m["train/loss"] == pytest.approx(-m["distill/advantage_mean"], abs=1e-4)
    assert "teacher_model" in json.loads((tmp_path / "run" / "config.json").read_text())["distillation"]


def test_a_teacher_equal_to_the_student_gives_zero_reward_at_the_sampling_temperature(server, tiny_model_path):
    """The teacher is scored at the temperature the student sampled at (0.7 here): with the student's own server as
    the teacher, log π_t^T − log π_s^T is 0 on every token (fp32), where a raw (T = 1) teacher is not."""
    from types import SimpleNamespace

    from training.recipes.config import Config
    from training.recipes.teacher import Teacher
    from training.utils.rl.groups import PromptGroup
    from training.utils.rl.rollout import RolloutSample

    cfg = Config(base_model=tiny_model_path, temperature=0.7, distillation=DistillationConfig(teacher_model="tiny"))
    prompt = [5, 17, 42, 99, 7]

    async def run() -> tuple[PromptGroup, dict]:
        sampler = DeploymentSampler(server.base_url)
        try:
            completions = await sampler.sample_with_prompt_tokens(
                prompt, n=4, max_tokens=16, seed=11, ignore_eos=True, temperature=0.7
            )
            group = PromptGroup(position=0, row={}, submit_version=0)
            for k, c in enumerate(completions):
                n_out = len(c.full_tokens) - c.prompt_len
                group.samples.append(
                    RolloutSample(
                        c.full_tokens,
                        [0.0] * c.prompt_len + c.inference_logprobs,
                        [0] * c.prompt_len + [1] * n_out,
                        0.0,
                    )
                )
                group.completion_index.append(k)
                group.completion_rewards[k] = 0.0
            group.compute_advantages()
            teacher = Teacher(cfg, SimpleNamespace(cfg=DeployConfig(), sampler=sampler))
            return group, await teacher.distill([group])
        finally:
            await sampler.close()

    group, metrics = asyncio.run(run())
    rewards = [a for s, adv in zip(group.samples, group.advantages) for a, m in zip(adv, s.loss_mask) if m]
    assert len(rewards) == 64 == metrics["distill/scored_tokens"]
    assert sum(abs(r) for r in rewards) / len(rewards) < 1e-4
    assert abs(metrics["distill/reverse_kl"]) < 1e-4


@pytest.mark.slow
def test_the_group_filter_runs_after_the_teacher_so_equal_reward_groups_still_distil(tiny_teacher_path, tmp_path):
    """Every group of the tiny model's random answers has reward 0 (no task signal): ``has_learning_signal``
    run before the teacher would drop them all and train nothing; run after it, it sees the teacher's per-token
    advantages and keeps them, so the step trains on the distillation signal."""
    from training.recipes import rl_loop
    from training.recipes.config import Config
    from training.utils.rl.filters import has_learning_signal

    rows = [{"prompt": f"what is {i} plus {i}?", "answer": "never"} for i in range(4)]
    cfg = Config(
        base_model="tiny",
        log_path=str(tmp_path / "run"),
        completions_per_prompt=2,
        prompt_groups_per_step=2,
        max_steps=1,
        max_tokens=8,
        deployment=DeployConfig(engine_config=EngineConfig(max_model_len=128, max_batch_size=8)),
        distillation=DistillationConfig(teacher_model=tiny_teacher_path),
        dynamic_filter_fn=has_learning_signal,
    )
    out = rl_loop.main(cfg, rows=rows)
    assert out["steps"] == 1
    m = out["last_metrics"]
    assert m["rollout/filtered_groups"] == 0 and m["distill/scored_tokens"] > 0 and "train/loss" in m


def test_an_explicit_grpo_is_kept_with_distillation_and_an_unset_loss_gets_the_distillation_default():
    """``"grpo"`` given (either spelling) is the user's choice even though it equals LossConfig's default; only a
    loss left unset becomes ``DISTILLATION_LOSS``."""
    from training.recipes.config import DISTILLATION_LOSS, Config
    from training.utils.rl.losses.config import DEFAULT_POLICY_LOSS

    on = DistillationConfig(teacher_model="tiny")
    for given in ({"policy_loss": "grpo"}, {"loss": LossConfig(policy_loss="grpo")}):
        cfg = Config(base_model="tiny", distillation=on, **given)
        assert cfg.loss.policy_loss == "grpo" and cfg.policy_loss == "grpo" and cfg.loss.kl_beta == 0.001, given
        assert cfg.loss.policy_loss_given
    assert Config(base_model="tiny", distillation=on, loss=LossConfig()).loss == DISTILLATION_LOSS
    assert not LossConfig().policy_loss_given and LossConfig().policy_loss == "grpo" == DEFAULT_POLICY_LOSS
    assert LossConfig() == LossConfig(policy_loss="grpo")  # equal settings: a resumed run compares as the same
    assert json.loads(json.dumps(Config(base_model="tiny").to_dict()))["loss"]["policy_loss"] == "grpo"
