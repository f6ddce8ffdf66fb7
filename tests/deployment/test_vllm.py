"""vLLM as the deployment engine, against a real vLLM CPU server (``pytest -m vllm``).

Needs ``.venv-vllm`` (``bash scripts/setup_vllm.sh``); without it the server tests skip with
that reason. One server is started for the module (~45-90 s on 2 cores) on a tiny Qwen3 with
tied embeddings and head_dim 32 (vLLM's CPU attention has no kernel for the default tiny
model's head_dim 16). Tests run in file order: each weight update builds on the previous one.
The tests at the top need no vLLM and run in the default suite.
"""

import asyncio
import os
import random
import sys
from pathlib import Path

import pytest
import torch

from tests.recipes.test_recipes import config as recipe_config
from training.deployment.backends.registry import make_deployment, make_sampler
from training.deployment.backends.process import DeploymentStartError
from training.deployment.client import DeploymentSampler
from training.deployment.backends.vllm import VLLM_VENV_PYTHON, VLLMDeployment
from training.utils import DeployConfig, EngineConfig
from training.utils.metrics import read_metrics

_no_venv = pytest.mark.skipif(
    not VLLM_VENV_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_VENV_PYTHON}: run bash scripts/setup_vllm.sh"
)


def needs_vllm(test):
    """Marks a test that runs against the real vLLM server (``-m vllm``; skipped without the venv)."""
    return pytest.mark.vllm(_no_venv(test))


PROMPT = [5, 17, 42, 99, 7, 300]
LOGPROB_TOL = 1e-4


# ----------------------------------------------------------------------- no server needed
def test_factory_picks_the_engine_class(tmp_path):
    assert type(make_deployment("m", DeployConfig(engine="vllm"))).__name__ == "VLLMDeployment"
    assert type(make_deployment("m", DeployConfig(engine="sglang"))).__name__ == "SGLangDeployment"
    assert type(make_deployment("m", DeployConfig())).__name__ == "EmbeddedDeployment"
    assert type(make_sampler(["http://h:1"], DeployConfig(engine="sglang"))).__name__ == "SGLangSampler"
    assert type(make_sampler(["http://h:1"], DeployConfig(engine="vllm"))) is DeploymentSampler
    attached = make_deployment("m", DeployConfig(), base_url="http://h:1/")
    assert attached.attached_url == "http://h:1" and attached.pid is None  # every engine attaches by URL
    with pytest.raises(ValueError, match="^base_url:"):
        make_deployment("m", DeployConfig(), base_url=["http://h:1", "http://h:2"])


def test_launch_command_and_env(tmp_path):
    dep = VLLMDeployment(
        "/models/x",
        DeployConfig(
            engine="vllm",
            api_key="sekret",
            engine_args=["--seed", "3"],
            engine_env={"VLLM_CPU_KVCACHE_SPACE": "1"},
            engine_config=EngineConfig(max_model_len=256),
        ),
        log_file=str(tmp_path / "v.log"),
    )
    dep.port = 1234
    cmd, env = dep._command(), dep._env()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in [
        ("--model", "/models/x"),
        ("--port", "1234"),
        ("--max-model-len", "256"),
        ("--logprobs-mode", "processed_logprobs"),
        ("--seed", "3"),
        ("--worker-extension-cls", "training.deployment.backends.vllm_worker.WeightReloadExtension"),
    ]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enforce-eager" in cmd and "sekret" not in " ".join(cmd)  # the key goes by env
    assert env["VLLM_API_KEY"] == "sekret" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_start_failure_raises_with_the_log_tail(tmp_path):
    # The project venv has no vLLM: the child dies at once and the error shows why.
    cfg = DeployConfig(engine="vllm", engine_python=sys.executable, startup_timeout_s=60)
    with pytest.raises(DeploymentStartError, match="(?s)exited with code.*No module named"):
        VLLMDeployment("/nonexistent", cfg, log_file=str(tmp_path / "v.log")).start()


def test_attach_to_a_dead_url_names_it():
    with pytest.raises(DeploymentStartError, match="127.0.0.1:9 is not healthy"):
        VLLMDeployment("m", DeployConfig(engine="vllm", base_url="http://127.0.0.1:9")).start()


def test_sampler_labels_versionless_answers_with_the_version_noted_before_sending():
    from training.deployment.client import _completion

    ch = {"index": 0, "token_ids": [3], "finish_reason": "stop"}
    assert _completion([1], ch, [-0.5], "", {}, 0, sent_under=4).weight_version == 4
    assert _completion([1], {**ch, "weight_version": 2}, [-0.5], "", {}, 0, sent_under=4).weight_version == 2
    s = DeploymentSampler("http://h:1")
    s.with_defaults(temperature=1.0).note_weight_version(3)  # shared by with_defaults copies
    assert s._client.noted_weight_version == 3


def test_an_unknown_vllm_version_is_refused_naming_it(monkeypatch):
    from training.deployment.backends.vllm import ANY_VERSION_ENV, check_vllm_version

    monkeypatch.delenv(ANY_VERSION_ENV, raising=False)
    check_vllm_version("0.32.0+cpu")  # the CPU build the suite tests
    check_vllm_version("0.33.1")
    for version in ("0.9.2", "0.40.0", "1.0.0", None, "dev"):
        with pytest.raises(DeploymentStartError, match="is not a version this adapter knows") as err:
            check_vllm_version(version)
        assert (version or "version unknown") in str(err.value) and ANY_VERSION_ENV in str(err.value)
    monkeypatch.setenv(ANY_VERSION_ENV, "1")
    check_vllm_version("0.40.0")


def test_pushes_go_in_the_dtype_vllm_serves(tmp_path, tiny_model_path, monkeypatch):
    """vLLM reports no dtype: the adapter says what it launched with, or the model's own for ``auto``."""
    bf16 = VLLMDeployment(tiny_model_path, DeployConfig(engine="vllm", engine_config=EngineConfig(dtype="bfloat16")))
    assert bf16.weight_dtype() == "bfloat16"
    on_cpu = VLLMDeployment(tiny_model_path, DeployConfig(engine="vllm", engine_config=EngineConfig(device="cpu")))
    assert on_cpu.weight_dtype() == "float32"  # a CPU server is launched in fp32
    monkeypatch.setattr(VLLMDeployment, "on_gpu", property(lambda self: True))  # as placed on a GPU (faked)
    on_gpu = VLLMDeployment(tiny_model_path, DeployConfig(engine="vllm"))
    assert on_gpu._command()[on_gpu._command().index("--dtype") + 1] == "auto"
    from transformers import AutoConfig

    expected = str(AutoConfig.from_pretrained(tiny_model_path).dtype).removeprefix("torch.")
    assert on_gpu.weight_dtype() == (expected if expected in ("float16", "bfloat16", "float32") else "bfloat16")


# ----------------------------------------------------------------------- real vLLM server
@pytest.fixture(scope="module")
def vllm_model_path():
    from training.models.build_tiny import build_tiny
    from training.utils.cache import cache_dir

    path = cache_dir() / "tiny-qwen3-h128"
    if not (path / "config.json").exists():
        build_tiny(path, hidden=128)  # 4 heads of 32; tie_word_embeddings=True
    return str(path)


@pytest.fixture(scope="module")
def server(vllm_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    cfg = DeployConfig(
        engine="vllm", startup_timeout_s=400, engine_config=EngineConfig(max_model_len=512, max_batch_size=16)
    )
    with VLLMDeployment(vllm_model_path, cfg, log_file=str(log)) as dep:
        print(f"\nvLLM startup: {dep.startup_s:.1f} s")
        yield dep


@pytest.fixture(scope="module")
def hf(vllm_model_path):
    """The transformers model the server's weights are compared with (updated alongside it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_model_path, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    return model


def saved_weights(model):
    """The model's tensors under their checkpoint names (a tied lm_head is not stored)."""
    return [(k, v.detach().clone()) for k, v in model.state_dict().items() if k != "lm_head.weight"]


def hf_logprobs(model, tokens, prompt_len, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return lp[prompt_len - 1 :].tolist()


def max_diff(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def run(coro):
    return asyncio.run(coro)


async def sample(dep, n=1, **kw):
    s = DeploymentSampler(dep.base_url)
    try:
        return await s.sample_with_prompt_tokens(PROMPT, n=n, **kw)
    finally:
        await s.close()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@needs_vllm
def test_token_level_sampling_matches_transformers(server, hf, temperature):
    completions = run(sample(server, n=2, max_tokens=12, temperature=temperature, seed=1, ignore_eos=True))
    assert len(completions) == 2
    for c in completions:
        assert c.prompt_tokens == PROMPT and len(c.output_tokens) == 12 and c.finish_reason == "length"
        assert len(c.inference_logprobs) == 12 and c.weight_version == 0
        diff = max_diff(c.inference_logprobs, hf_logprobs(hf, c.full_tokens, c.prompt_len, temperature))
        print(f"T={temperature}: max |vLLM - transformers| logprob = {diff:.2e}")
        assert diff < LOGPROB_TOL


@needs_vllm
def test_stop_token_gives_finish_reason_stop(server):
    (greedy,) = run(sample(server, max_tokens=4, temperature=0.0, ignore_eos=True))
    third = greedy.output_tokens[2]
    (c,) = run(sample(server, max_tokens=8, temperature=0.0, stop_token_ids=[third]))
    assert c.finish_reason == "stop" and c.output_tokens[-1] == third and len(c.output_tokens) <= 3


def _perturb(hf, scale, names):
    gen = torch.Generator().manual_seed(len(names))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if any(name.startswith(n) for n in names):
                p.add_(scale * torch.randn(p.shape, generator=gen) * p.std().clamp_min(1e-3))


@needs_vllm
def test_weight_update_changes_outputs_version_and_tied_output_projection(server, hf, tmp_path):
    (before,) = run(sample(server, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True))
    # Change every weight, the (tied) embedding included.
    _perturb(hf, 0.5, ["model."])
    out = run(server.push_weights(saved_weights(hf), 1, mode="disk", directory=str(tmp_path / "w1")))
    print(f"\nvLLM weight sync: {out['total_s']:.2f} s (reload {out['reload_s']:.2f} s), refreshed {out['refreshed']}")

    async def after_sync():
        s = DeploymentSampler(server.base_url)
        s.note_weight_version(1)  # what the recipe does once the sync returned
        try:
            return await s.sample_with_prompt_tokens(PROMPT, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
        finally:
            await s.close()

    (after,) = run(after_sync())
    assert run(server.server_weight_version()) == "1" and after.weight_version == 1
    # (a random tied model often repeats one token, so compare the logprobs too)
    assert (
        after.output_tokens != before.output_tokens
        or max_diff(after.inference_logprobs, before.inference_logprobs) > 1e-2
    )
    diff = max_diff(after.inference_logprobs, hf_logprobs(hf, after.full_tokens, after.prompt_len))
    print(f"after reload: max |vLLM - transformers(new weights)| logprob = {diff:.2e}")
    assert diff < LOGPROB_TOL, "the server does not compute with the new weights (tied output projection stale?)"


@needs_vllm
def test_bare_vllm_reload_keeps_a_stale_tied_output_projection(server, hf, tmp_path):
    """vLLM 0.32's own reload_weights leaves the CPU-prepacked lm_head on the old embedding;
    the worker extension's reload repairs it. If this starts failing, vLLM fixed the pitfall."""
    _perturb(hf, 0.5, ["model.embed_tokens"])
    server.refresh_tied_output = False
    try:
        run(server.push_weights(saved_weights(hf), 2, mode="shm"))
    finally:
        server.refresh_tied_output = True
    (stale,) = run(sample(server, max_tokens=6, temperature=1.0, seed=0, ignore_eos=True))
    stale_diff = max_diff(stale.inference_logprobs, hf_logprobs(hf, stale.full_tokens, stale.prompt_len))
    run(server.push_weights(saved_weights(hf), 3, mode="shm"))
    (fixed,) = run(sample(server, max_tokens=6, temperature=1.0, seed=0, ignore_eos=True))
    fixed_diff = max_diff(fixed.inference_logprobs, hf_logprobs(hf, fixed.full_tokens, fixed.prompt_len))
    print(f"\nbare reload: diff {stale_diff:.2e}; with the extension: {fixed_diff:.2e}")
    assert stale_diff > 1e-2 and fixed_diff < LOGPROB_TOL


@needs_vllm
def test_sync_waits_for_in_flight_requests(server, hf, tmp_path):
    """pause mode 'wait': a request in flight during a sync completes (not aborted) on the old weights."""

    async def scenario():
        s = DeploymentSampler(server.base_url)
        s.note_weight_version(3)
        long = asyncio.create_task(
            s.sample_with_prompt_tokens(PROMPT, max_tokens=300, temperature=1.0, ignore_eos=True)
        )
        await asyncio.sleep(0.3)
        await server.push_weights(saved_weights(hf), 4, mode="shm")
        s.note_weight_version(4)
        (c,) = await long
        await s.close()
        return c

    c = run(scenario())
    assert c.finish_reason == "length" and len(c.output_tokens) == 300 and c.weight_version == 3
    assert run(server.server_weight_version()) == "4"


ROWS = [{"id": i, "prompt_ids": [1, 10 + i, 20 + i % 7, 201]} for i in range(16)]


def labelling_rollouts(labels):
    """A rollout factory that records each completion's weight-version label."""
    from training.utils.rl.rollout import RolloutSample

    def factory(setup):
        sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)

        async def rollout_fn(row):
            (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
            labels.append(c.weight_version)
            out = c.output_tokens
            return RolloutSample(
                tokens=c.full_tokens,
                logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
                loss_mask=[0] * c.prompt_len + [1] * len(out),
                reward=sum(t % 2 == 0 for t in out) / len(out) + 1e-3 * random.random(),
            )

        return rollout_fn

    return factory


@needs_vllm
def test_async_rl_loop_attached_to_vllm(server, vllm_model_path, tmp_path):
    """Two steps of async_rl_loop with deployment.engine='vllm' attached to the module's server."""
    from training.recipes import async_rl_loop

    labels = []
    cfg = recipe_config(
        vllm_model_path, None, tmp_path, deployment=DeployConfig(engine="vllm", base_url=server.base_url)
    )
    result = async_rl_loop.main(cfg, rollout_fn_factory=labelling_rollouts(labels), rows=ROWS)
    assert result["steps"] == 2
    assert run(server.server_weight_version()) == "2"  # synced v0 at start, then after each step
    assert labels and set(labels) <= {0, 1, 2}


@needs_vllm
def test_the_mismatch_monitor_measures_vllm_against_the_trainer(server, vllm_model_path, tmp_path, caplog):
    """The mismatch probes (training/utils/rl/mismatch_probe.py) forced on (a threshold under any gap) against vLLM's
    CPU build: they report its |Δ logprob| to the trainer and either name a cause or say none removes it."""
    import logging

    from training.recipes import rl_loop

    cfg = recipe_config(
        vllm_model_path,
        None,
        tmp_path,
        deployment=DeployConfig(engine="vllm", base_url=server.base_url),
        mismatch_probe_threshold=1e-12,
    )
    with caplog.at_level(logging.WARNING, logger="training.recipe"):
        rl_loop.main(cfg, rollout_fn_factory=labelling_rollouts([]), rows=ROWS)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("logprob mismatch")]
    print(f"\n{line}")
    assert "engine_prefill " in line and ("cause:" in line or "none of the probes removes it" in line)
    [m] = [r for r in read_metrics(cfg.log_path) if "mismatch/trainer_mean" in r]
    assert m["mismatch/trainer_mean"] < 1e-3  # fp32 on both sides


@needs_vllm
def test_async_rl_loop_launches_vllm(vllm_model_path, tmp_path):
    """The recipe launches its own vLLM server (shm weight sync) and stops it at the end."""
    from training.recipes import async_rl_loop

    labels = []
    shm_before = set(Path("/dev/shm").glob(f"training-vllm-{os.getpid()}-*"))
    cfg = recipe_config(
        vllm_model_path,
        None,
        tmp_path,
        deployment=DeployConfig(
            engine="vllm", startup_timeout_s=400, engine_config=EngineConfig(max_model_len=512, max_batch_size=8)
        ),
    )
    result = async_rl_loop.main(cfg, rollout_fn_factory=labelling_rollouts(labels), rows=ROWS)
    assert result["steps"] == 2 and labels and set(labels) <= {0, 1}
    log = (tmp_path / "run" / "deployment.log").read_text()
    assert "vllm.entrypoints.openai.api_server" in log  # the launch line the deployment logged
    assert set(Path("/dev/shm").glob(f"training-vllm-{os.getpid()}-*")) == shm_before  # its shm folder is gone
