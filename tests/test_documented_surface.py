"""Files written against the Fireworks cookbook's documented ``async_rl_loop`` / ``rl_loop`` surface run here
unmodified (issue #15): the documented ``rollout.py`` / ``train.py`` pair, ``rl_loop.main(cfg)`` with ``dataset``,
and each documented name next to our own spelling of the same setting.

The end-to-end runs use the tiny model as ``base_model`` and ``tokenizer_model`` and launch their own embedded
server, as the documented files do; the helpers below share one module server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from training.deployment.client import DeploymentSampler
from training.proxy import ProxyServer
from training.recipes import async_rl_loop, rl_loop
from training.recipes.single_turn import exact_match_reward, make_single_turn_rollout_fn
from training.utils import DeployConfig, LossConfig, TrainerConfig, WandBConfig
from training.utils.cli import apply_overrides, help_text
from training.utils.data import RowCursor, load_rows
from training.utils.http import AFFINITY_HEADER, SESSION_HEADER, session_headers, session_id_of
from training.utils.metrics import read_metrics
from training.utils.rl.groups import PromptGroup
from training.utils.rl.losses import LOSSES
from training.utils.rl.rollout import RolloutRun, RolloutSample, RolloutSetup, flatten_result


# The rollout.py of the documentation, with a reward of our own for `score` (the docs leave it to the user).
ROLLOUT_PY = """\
from training.examples.rl.vanilla_sampler import build_deployment_sampler
from training.utils.rl.rollout import RolloutSample


def score(c) -> float:
    output = list(c.full_tokens)[c.prompt_len:]
    return sum(t % 2 == 0 for t in output) / max(len(output), 1)


def make_rollout_fn(setup):
    sampler = build_deployment_sampler(setup)
    sample_kwargs = dict(setup.sample_kwargs)

    async def rollout_fn(sample_prompt: dict) -> RolloutSample | None:
        completions = await sampler.sample_with_prompt_tokens(
            sample_prompt["prompt_token_ids"], n=1, **sample_kwargs,
        )
        if not completions:
            return None
        c = completions[0]
        output = list(c.full_tokens)[c.prompt_len:]
        return RolloutSample(
            tokens=list(c.full_tokens),
            logprobs=[0.0] * c.prompt_len + list(c.inference_logprobs),
            loss_mask=[0] * c.prompt_len + [1] * len(output),
            reward=score(c),
            finish_reason=c.finish_reason,
            text=c.text,
        )

    return rollout_fn
"""

# The train.py of the documentation: the same fields, the tiny model, and group sizes that run in seconds on CPU.
TRAIN_PY = """\
from training.recipes.async_rl_loop import Config, main
from training.utils import DeployConfig, TrainerConfig, WandBConfig
from rollout import make_rollout_fn

cfg = Config(
    log_path="./gsm8k_logs",
    base_model={model!r},
    learning_rate=1.7e-5,
    completions_per_prompt=2,
    prompt_groups_per_step=2,
    policy_loss={loss!r},
    max_head_offpolicy_versions=4,
    trainer=TrainerConfig(training_shape_id="accounts/fireworks/trainingShapes/qwen3-8b-128k-h200"),
    deployment=DeployConfig(tokenizer_model={model!r}),
    wandb=WandBConfig(entity="my-team", project="gsm8k-rl"),
)

rows = [{{"prompt_token_ids": [1, 10 + i, 20 + i % 7, 201]}} for i in range(4)]
main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows)
"""


def write_pair(folder: Path, model: str, loss: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rollout.py").write_text(ROLLOUT_PY)
    (folder / "train.py").write_text(TRAIN_PY.format(model=model, loss=loss))
    return folder


def check_documented_run(folder: Path, loss: str) -> None:
    metrics = [r for r in read_metrics(folder / "gsm8k_logs") if "train/loss" in r]
    assert [r["step"] for r in metrics] == [0, 1], f"{loss}: {metrics}"
    assert all(r["rollout/samples"] == 4 and r["train/grad_norm"] > 0 for r in metrics), f"{loss}: {metrics}"
    assert (folder / "gsm8k_logs" / "final" / "config.json").is_file()


def test_documented_rollout_and_train_files_run_unmodified(tiny_model_path, tmp_path):
    """`python train.py` as a user runs it: the documented pair, two steps, then the exported model."""
    folder = write_pair(tmp_path / "grpo", tiny_model_path, "grpo")
    env = {**os.environ, "WANDB_MODE": "disabled"}  # wandb is optional; the config itself is the documented one
    proc = subprocess.run(
        [sys.executable, "train.py"], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_documented_run(folder, "grpo")
    assert proc.stderr.count(async_rl_loop.EXPERIMENTAL_NOTICE) <= 1  # once per installation: shown or not yet
    assert (
        "training_shape_id='accounts/fireworks/trainingShapes/qwen3-8b-128k-h200' is a hosted training shape: "
        "no local effect" in proc.stderr
    )


@pytest.mark.slow
def test_documented_files_train_with_every_policy_loss(tiny_model_path, tmp_path, monkeypatch):
    """The same pair with each registered `policy_loss` name, in one process (several minutes on 2 cores)."""
    import runpy

    monkeypatch.setenv("WANDB_MODE", "disabled")
    for loss in sorted(LOSSES):
        folder = write_pair(tmp_path / loss, tiny_model_path, loss)
        monkeypatch.chdir(folder)
        monkeypatch.syspath_prepend(str(folder))
        sys.modules.pop("rollout", None)
        runpy.run_path(str(folder / "train.py"), run_name="__main__")
        check_documented_run(folder, loss)


def test_documented_rl_loop_snippet_runs_with_main_cfg(tiny_model_path, tmp_path, monkeypatch, caplog):
    """`rl_loop.main(cfg)` with `dataset` and `max_rows`: the built-in single-turn rollout, exact-match reward,
    the served model named by `deployment_id`, and `output_model_id` promoting the exported folder."""
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(5)]
    dataset = tmp_path / "gsm8k.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="training.recipe")
    cfg = rl_loop.Config(
        log_path="./grpo_logs",
        base_model=tiny_model_path,
        dataset=str(dataset),
        max_rows=2,
        completions_per_prompt=4,
        policy_loss="grpo",
        trainer=TrainerConfig(training_shape_id="accounts/fireworks/trainingShapes/qwen3-8b-128k-h200"),
        deployment=DeployConfig(deployment_id="grpo-serving", tokenizer_model=tiny_model_path),
        weight_sync_interval=1,
        output_model_id="grpo-tiny",
        max_tokens=8,
    )
    out = rl_loop.main(cfg)
    assert out["steps"] == 1
    trained = [json.loads(line) for line in (tmp_path / "grpo_logs" / "rollouts.jsonl").read_text().splitlines()]
    assert len(trained) == 8 and {t["row_position"] for t in trained} == {0, 1}  # max_rows: only 2 of 5 rows
    cursor = RowCursor(2, cfg.epochs, cfg.seed, cfg.shuffle_rows)
    for t in trained:  # the default reward is exact match against the row's answer
        assert t["reward"] == float(t["text"].strip() == rows[cursor.row_index(t["row_position"])]["answer"])
    promoted = tmp_path / "grpo_logs" / "grpo-tiny"
    assert out["output_model"] == str(promoted) and (promoted / "model.safetensors").is_file()
    assert f"promoted the final policy as 'grpo-tiny': {promoted}" in caplog.text
    assert "deployment 'grpo-serving'" in caplog.text
    assert "grpo-serving" in (tmp_path / "grpo_logs" / "deployment.log").read_text()


# ---- one setting, two spellings ------------------------------------------------------------------------------------


def test_top_level_learning_rate_policy_loss_kl_beta_are_the_nested_settings():
    cfg = async_rl_loop.Config(base_model="tiny", learning_rate=1.7e-5, policy_loss="gspo", kl_beta=0.0)
    assert (cfg.trainer.learning_rate, cfg.loss.policy_loss, cfg.loss.kl_beta) == (1.7e-5, "gspo", 0.0)
    assert (cfg.learning_rate, cfg.policy_loss, cfg.kl_beta) == (1.7e-5, "gspo", 0.0)
    nested = async_rl_loop.Config(
        base_model="tiny", trainer=TrainerConfig(learning_rate=3e-4), loss=LossConfig(policy_loss="cispo")
    )
    assert (nested.learning_rate, nested.policy_loss) == (3e-4, "cispo")  # the alias reads the nested value
    same = async_rl_loop.Config(base_model="tiny", learning_rate=3e-4, trainer=TrainerConfig(learning_rate=3e-4))
    assert same.trainer.learning_rate == 3e-4


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (
            dict(learning_rate=1.7e-5, trainer=TrainerConfig(learning_rate=3e-4)),
            ("learning_rate=", "trainer.learning_rate="),
        ),
        (
            dict(policy_loss="dapo", loss=LossConfig(policy_loss="gspo")),
            ("policy_loss='dapo'", "loss.policy_loss='gspo'"),
        ),
        (dict(kl_beta=0.1, loss=LossConfig(kl_beta=0.0)), ("kl_beta=0.1", "loss.kl_beta=0.0")),
    ],
)
def test_both_spellings_with_different_values_is_an_error_naming_both(kwargs, names):
    with pytest.raises(ValueError) as e:
        async_rl_loop.Config(base_model="tiny", **kwargs)
    assert all(n in str(e.value) for n in names), str(e.value)


def test_logs_and_help_show_one_value_and_overrides_take_either_spelling():
    cfg = async_rl_loop.Config(base_model="tiny", learning_rate=1.7e-5, policy_loss="dro")
    logged = cfg.to_dict()
    assert not {"learning_rate", "policy_loss", "kl_beta"} & set(logged)
    assert logged["trainer"]["learning_rate"] == 1.7e-5 and logged["loss"]["policy_loss"] == "dro"
    text = help_text(cfg)
    assert "learning_rate=1.7e-05" in text and text.count("1.7e-05") == 1  # the nested field, once
    assert "the same setting as trainer.learning_rate" in text
    a = apply_overrides(cfg, ["learning_rate=3e-4", "policy_loss=cispo", "kl_beta=0.5"])
    b = apply_overrides(cfg, ["trainer.learning_rate=3e-4", "loss.policy_loss=cispo", "loss.kl_beta=0.5"])
    assert a == b and (a.trainer.learning_rate, a.loss.policy_loss, a.loss.kl_beta) == (3e-4, "cispo", 0.5)
    assert a.learning_rate == 3e-4


def test_documented_sub_config_fields_are_accepted(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    deploy = DeployConfig(deployment_id="grpo-serving", tokenizer_model="Qwen/Qwen3-8B")
    assert (deploy.deployment_id, deploy.tokenizer_model) == ("grpo-serving", "Qwen/Qwen3-8B")
    assert TrainerConfig(training_shape_id="accounts/fireworks/trainingShapes/x").training_shape_id.endswith("/x")
    wandb = WandBConfig(entity="my-team", project="gsm8k-rl")
    assert wandb.enabled and (wandb.entity, wandb.mode) == ("my-team", "online")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert not WandBConfig(entity="my-team", project="gsm8k-rl").enabled
    with pytest.raises(ValueError, match="deployment_id"):
        DeployConfig(deployment_id="")
    with pytest.raises(ValueError, match="output_model_id"):
        async_rl_loop.Config(base_model="tiny", output_model_id="m", export_final_model=False)


def test_dynamic_filter_receives_a_prompt_group_with_rewards():
    def sample(reward):
        return RolloutSample(tokens=[1, 2], logprobs=[0.0, -1.0], loss_mask=[0, 1], reward=reward)

    group = PromptGroup(position=0, row={}, submit_version=0)
    for k, r in enumerate([1.0, 0.0, 1.0]):
        group.samples.append(sample(r))
        group.completion_index.append(k)
        group.completion_rewards[k] = r
    documented = lambda pg: len(set(pg.rewards)) > 1  # noqa: E731 - as the documentation writes it
    assert documented(group) and group.rewards == [1.0, 0.0, 1.0]
    assert len(group) == 3 and [s.reward for s in group] == group.rewards and group[1].reward == 0.0
    group.completion_rewards = {0: 1.0, 1: 1.0}
    assert not documented(group)


def test_rollout_contract_as_documented():
    sample = RolloutSample(tokens=[1, 2, 3], logprobs=[0.0, -0.5, -0.1], loss_mask=[0, 1, 1], reward=1.0)
    assert (sample.finish_reason, sample.text) == ("stop", "")
    assert flatten_result(None) == []  # return None drops the completion
    run = RolloutRun(segments=[sample, RolloutSample([4, 5], [0.0, -0.2], [0, 1], reward=0.0)], reward=0.5)
    assert [s.reward for s in flatten_result(run)] == [0.5, 0.5]
    setup = RolloutSetup(sampler=None, tokenizer=None, sampling_kwargs={"max_tokens": 8})
    assert setup.sample_kwargs is setup.sampling_kwargs  # one dict, two names
    setup.sample_kwargs["temperature"] = 0.5
    assert setup.sampling_kwargs == {"max_tokens": 8, "temperature": 0.5}


def test_rollout_failure_error_still_imports_from_its_old_path():
    """``training.recipes.common`` was its documented home before the recipes were split by what they hold."""
    from training.recipes.common import RolloutFailureError as old_path
    from training.recipes.context import RolloutFailureError

    assert old_path is RolloutFailureError


def test_rows_carry_prompt_ids_under_both_names(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n" + json.dumps({"prompt_ids": [3]}) + "\n")
    rows = load_rows(path)
    assert [(r["prompt_token_ids"], r["prompt_ids"]) for r in rows] == [([1, 2], [1, 2]), ([3], [3])]
    mine = {"prompt_ids": [7], "prompt_token_ids": [8]}
    assert load_rows([mine])[0] is mine  # both given: left as they are


def test_turn_matching_lives_at_the_documented_path_and_the_proxy_uses_it():
    import training.proxy as proxy
    from training.proxy import forwarding as proxy_forwarding  # where the proxy labels each call it records
    from training.utils.rl.rollout import turn_matching

    assert proxy.classify is turn_matching.classify and proxy_forwarding.assign is turn_matching.assign
    assert turn_matching.STRATEGIES == ("messages", "tokens")

    class Call:
        def __init__(self, prompt, output, messages=None):
            self.prompt_ids, self.output_ids, self.messages, self.tools = prompt, output, messages, None
            self.response_message = {"role": "assistant", "content": "x"} if messages else None

        @property
        def full_ids(self):
            return self.prompt_ids + self.output_ids

    first = Call([1, 2], [3])
    assert turn_matching.classify(None, first).kind == turn_matching.NEW
    assert turn_matching.classify(first, Call([1, 2, 3, 4], [5]), "tokens").kind == turn_matching.APPEND
    wiped = turn_matching.classify(first, Call([1, 9], [5]), "tokens")
    assert (wiped.kind, wiped.reason) == (turn_matching.WIPE, "token prefix broken at position 1")
    msgs = [{"role": "user", "content": "hi"}]
    by_messages = turn_matching.classify(
        Call([1], [2], msgs),
        Call([1, 7], [2], msgs + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]),
    )
    assert by_messages.kind == turn_matching.APPEND and by_messages.token_drift  # messages decide by default


def test_session_id_comes_from_either_header_or_the_user_field():
    assert session_id_of({SESSION_HEADER: "a", AFFINITY_HEADER: "b"}, {"user": "c"}) == "a"
    assert session_id_of({AFFINITY_HEADER: "b"}, {"user": "c"}) == "b"
    assert session_id_of({}, {"user": "c"}) == "c"
    assert session_id_of({}, {"user": ""}) is None and session_id_of({}, None) is None
    assert session_headers("s") == {SESSION_HEADER: "s", AFFINITY_HEADER: "s"} and session_headers(None) == {}


def test_experimental_notice_is_logged_once_per_installation(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(async_rl_loop, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(async_rl_loop, "run_recipe", lambda *a, **kw: {"steps": 0})
    with caplog.at_level(logging.WARNING, logger="training.recipe"):
        async_rl_loop.main(async_rl_loop.Config(base_model="tiny"))
        async_rl_loop.main(async_rl_loop.Config(base_model="tiny"))
    assert caplog.text.count(async_rl_loop.EXPERIMENTAL_NOTICE) == 1
    assert (tmp_path / "cache" / async_rl_loop.NOTICE_MARKER).is_file()  # later processes stay quiet too
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="training.recipe"):
        async_rl_loop.main(async_rl_loop.Config(base_model="tiny", show_experimental_notice=True))
        async_rl_loop.main(async_rl_loop.Config(base_model="tiny", show_experimental_notice=False))
    assert caplog.text.count(async_rl_loop.EXPERIMENTAL_NOTICE) == 1


def test_exact_match_reward():
    assert exact_match_reward(" 42\n", {"answer": 42}) == 1.0
    assert exact_match_reward("42.", {"answer": "42"}) == 0.0
    assert exact_match_reward("42", {}) == 0.0


# ---- against a real server -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(deployment_id="grpo-serving", max_batch_size=16, max_model_len=512)


def post(server, body, headers):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(server.base_url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                return await r.json()

    return asyncio.run(go())


@pytest.mark.parametrize("how", ["affinity_header", "user_field"])
def test_server_keeps_a_session_kv_cache_named_by_affinity_header_or_user_field(server, how):
    headers = {AFFINITY_HEADER: f"s-{how}"} if how == "affinity_header" else {}
    extra = {"user": f"s-{how}"} if how == "user_field" else {}
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    one = post(
        server, {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True, **extra}, headers
    )
    turn2 = prompt + one["choices"][0]["token_ids"] + [30, 31]
    two = post(server, {"prompt": turn2, "max_tokens": 2, "return_token_ids": True, **extra}, headers)
    assert 0 < two["usage"]["prompt_tokens_details"]["cached_tokens"] < len(turn2), two["usage"]


def test_proxy_records_a_session_named_by_affinity_header_or_user_field(server):
    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {proxy.api_key}"}) as s:
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                async with s.post(
                    proxy.base_url + "/chat/completions", json=body, headers={AFFINITY_HEADER: "by-header"}
                ) as r:
                    assert r.status == 200, await r.text()
                async with s.post(proxy.base_url + "/chat/completions", json={**body, "user": "by-user"}) as r:
                    assert r.status == 200, await r.text()
                async with s.post(proxy.base_url + "/chat/completions", json=body) as r:
                    unnamed = (r.status, await r.json())
            return proxy.close_session("by-header"), proxy.close_session("by-user"), unnamed

    by_header, by_user, unnamed = asyncio.run(go())
    assert len(by_header.calls) == 1 and len(by_user.calls) == 1
    assert unnamed[0] == 400 and "x-session-affinity" in unnamed[1]["error"]["message"]


def test_builtin_rollout_reads_messages_token_ids_or_a_prompt(server, tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    sampler = DeploymentSampler(server.base_url, model="grpo-serving")  # the served name (deployment_id)
    setup = RolloutSetup(sampler=sampler, tokenizer=tokenizer, sampling_kwargs={"max_tokens": 4, "temperature": 1.0})
    seen = []

    def reward_fn(text, row):
        seen.append((text, row["answer"]))
        return 0.25

    rollout_fn = make_single_turn_rollout_fn(reward_fn)(setup)
    rows = [
        {"messages": [{"role": "user", "content": "2 + 2?"}], "answer": "4"},
        {"prompt_token_ids": [1, 10, 20, 201], "answer": "5"},
        {"prompt": "Repeat 7:", "answer": "7"},
    ]

    async def go():
        try:
            return await asyncio.gather(*(rollout_fn(r) for r in rows))
        finally:
            await sampler.close()

    chat, ids, text = asyncio.run(go())
    prompt_text = tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False, add_generation_prompt=True)
    assert chat.tokens[: chat.loss_mask.index(1)] == tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    assert ids.tokens[:4] == [1, 10, 20, 201] and ids.loss_mask[:4] == [0, 0, 0, 0]
    assert text.tokens[: text.loss_mask.index(1)] == tokenizer("Repeat 7:", add_special_tokens=False)["input_ids"]
    for s in (chat, ids, text):
        flatten_result(s)  # valid samples
        assert s.reward == 0.25 and 1 <= sum(s.loss_mask) <= 4
    assert sorted(a for _, a in seen) == ["4", "5", "7"]
    with pytest.raises(ValueError, match="'messages', 'prompt_token_ids' or 'prompt'"):
        asyncio.run(rollout_fn({"question": "?"}))


def test_tokenizer_model_is_loaded_and_checked_against_the_model_vocabulary(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from training.recipes.resources import rollout_tokenizer

    policy = object()
    copy = tmp_path / "tokenizer"
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(copy)  # another folder, the same tokenizer
    cfg = async_rl_loop.Config(base_model=tiny_model_path, deployment=DeployConfig(tokenizer_model=str(copy)))
    assert rollout_tokenizer(async_rl_loop.Config(base_model=tiny_model_path), tiny_model_path, policy, 512) is policy
    loaded = rollout_tokenizer(cfg, tiny_model_path, policy, vocab_size=512)
    assert loaded is not policy and loaded.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_path).get_vocab()
    with pytest.raises(ValueError, match=r"deployment.tokenizer_model: .* has \d+ tokens, more than the vocabulary"):
        rollout_tokenizer(cfg, tiny_model_path, policy, vocab_size=100)
    missing = async_rl_loop.Config(base_model="tiny", deployment=DeployConfig(tokenizer_model=str(tmp_path / "none")))
    with pytest.raises(ValueError, match="deployment.tokenizer_model: cannot load"):
        rollout_tokenizer(missing, tiny_model_path, policy, vocab_size=512)


def test_rows_come_from_main_or_dataset_and_max_rows_caps_them(tmp_path):
    from training.recipes.resources import resolve_rows

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"answer": str(i)}) + "\n" for i in range(5)))
    assert len(resolve_rows(async_rl_loop.Config(base_model="tiny", dataset=str(path)), None)) == 5
    capped = resolve_rows(async_rl_loop.Config(base_model="tiny", max_rows=2), str(path))
    assert [r["answer"] for r in capped] == ["0", "1"]
    with pytest.raises(ValueError, match="rows: main\\(\\) got rows and cfg.dataset"):
        resolve_rows(async_rl_loop.Config(base_model="tiny", dataset=str(path)), [{"a": 1}])
    with pytest.raises(ValueError, match="got no rows and cfg.dataset is None"):
        resolve_rows(async_rl_loop.Config(base_model="tiny"), None)


# ---- the README's tour and GPU quickstart, as pasted ----------------------------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_between(start: str, end: str) -> str:
    text = README.read_text()
    return text[text.index(start) : text.index(end)]


def test_the_readme_tour_runs_as_pasted(tiny_model_path, tmp_path):
    """The tour's two blocks, saved as ``rollout.py`` and ``train.py`` side by side: ``python train.py`` trains a step."""
    import re

    blocks = re.findall(r"^```python\n(.*?)^```$", readme_between("## A 60-second tour", "### Examples"), re.M | re.S)
    rollout_py, train_py = blocks
    (tmp_path / "rollout.py").write_text(rollout_py)
    (tmp_path / "train.py").write_text(train_py)
    env = {**os.environ, "PYTHONPATH": str(README.parent), "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [r for r in read_metrics(tmp_path / "runs" / "my_run") if "train/loss" in r]
    assert [r["step"] for r in metrics] == [0] and metrics[0]["rollout/samples"] == 8
    assert (tmp_path / "runs" / "my_run" / "final" / "config.json").is_file()


def quickstart_commands() -> list[list[str]]:
    """The shell commands of the README's GPU quickstart, continuation lines joined, comments cut, as argv lists."""
    import re
    import shlex

    section = readme_between("### GPU quickstart", "### Where everything goes")
    commands = []
    for body in re.findall(r"^```bash\n(.*?)^```$", section, re.M | re.S):
        for command in body.replace("\\\n", " ").splitlines():
            commands.append(shlex.split(command.split("  #", 1)[0]))
    return commands


def test_the_gpu_quickstart_commands_place_the_trainer_and_servers_as_documented(monkeypatch):
    """The one-GPU command colocates the server with the trainer on GPU 0; the 8-GPU command under
    ``torchrun --nproc-per-node 4`` gives the trainer GPUs 0-3 and one vLLM replica each of GPUs 4-7; the memory
    plan's settings are the 8-GPU command's."""
    import copy

    from training.deployment.placement import plan_placement
    from training.examples.rl.arithmetic_smollm2.train import cfg
    from training.utils.cli import apply_overrides

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # apply_overrides installs the one-line hook
    runs = [
        a
        for a in quickstart_commands()
        if a[:2] == [".venv/bin/python", "training/examples/rl/arithmetic_smollm2/train.py"]
        or a[0] == ".venv/bin/torchrun"
    ]
    assert len(runs) == 2
    (one_gpu, node) = runs

    one = apply_overrides(copy.deepcopy(cfg), one_gpu[2:])
    assert one.deployment.colocate and one.trainer.offload_optimizer
    placement = plan_placement(one.deployment, one.trainer, num_gpus=1)
    assert placement.trainer == ("cuda:0",) and [r.label for r in placement.replicas] == ["cuda:0"]

    nproc = int(node[node.index("--nproc-per-node") + 1])
    settings = node[node.index("training/examples/rl/arithmetic_smollm2/train.py") + 1 :]
    eight = apply_overrides(copy.deepcopy(cfg), settings)
    assert eight.deployment.engine == "vllm" and eight.deployment.gpu_memory_fraction == 0.85
    placement = plan_placement(eight.deployment, eight.trainer, num_gpus=8, local_world_size=nproc)
    assert placement.trainer == tuple(f"cuda:{g}" for g in range(4))
    assert [r.label for r in placement.replicas] == [f"cuda:{g}" for g in range(4, 8)]

    (plan,) = [a for a in quickstart_commands() if a[1:3] == ["-m", "training.memory_plan"]]
    assert set(a for a in plan if "=" in a) <= set(settings)
