"""The distributed weight push into a real vLLM CPU server over gloo (``pytest -m vllm``).

Trainer = this process (rank 0 of its own group); the vLLM server's worker = rank 1, joined through the
worker extension over ``POST /collective_rpc``. One server for the module (launched like
``tests/deployment/test_vllm.py``'s, on the same tiny tied-embedding Qwen3, fp32 as vLLM serves on CPU), attached
by a ``DeploymentGroup`` with ``weight_sync="distributed"``. The tests run in file order: each push builds on
the versions before it. The test at the top needs no vLLM and runs in the default suite.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.deployment.test_vllm import hf_logprobs, max_diff, needs_vllm, saved_weights, vllm_model_path  # noqa: F401
from training.deployment.backends.vllm import VLLMDeployment
from training.deployment.client import DeploymentSampler
from training.deployment.group import DeploymentGroup
from training.deployment.weights.files import WeightSyncError
from training.utils import DeployConfig, EngineConfig
from training.utils.backends import BACKENDS

PROMPT = [5, 17, 42, 99, 7, 300]
LOGPROB_TOL = 1e-4


def test_vllm_takes_the_distributed_push_through_its_own_sender():
    cfg = DeployConfig(
        engine="vllm", base_url="http://h:1", weight_sync="distributed", weight_sync_master_addr="127.0.0.1"
    )
    assert cfg.weight_sync == "distributed"
    assert BACKENDS["vllm"].weight_sender.endswith("vllm_weights:VLLMWeightSender")
    group = DeploymentGroup.attach(["http://h:1"], cfg)
    sender = group._distributed_sender()
    assert type(sender).__name__ == "VLLMWeightSender" and sender.replicas == group.replicas
    group.stop()


# ----------------------------------------------------------------------- real vLLM server
@pytest.fixture(scope="module")
def server(vllm_model_path, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    cfg = DeployConfig(
        engine="vllm", startup_timeout_s=400, engine_config=EngineConfig(max_model_len=512, max_batch_size=8)
    )
    with VLLMDeployment(vllm_model_path, cfg, log_file=str(log)) as dep:
        print(f"\nvLLM startup: {dep.startup_s:.1f} s")
        yield dep


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: the group's sender lives across tests."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def group(server, vllm_model_path, loop):  # noqa: F811
    cfg = DeployConfig(
        engine="vllm",
        base_url=server.base_url,
        weight_sync="distributed",
        weight_sync_master_addr="127.0.0.1",
        weight_sync_backend="gloo",
        weight_bucket_mb=0.05,  # several buckets for the 1.4 MB model
        request_timeout_s=120,
    )
    g = DeploymentGroup(vllm_model_path, cfg).start()
    yield g
    loop.run_until_complete(g.close_sampler())
    g.stop()


@pytest.fixture(scope="module")
def hf(vllm_model_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_path, dtype=torch.float32).eval()


def sample(server, loop, version=None, **kw):
    async def go():
        s = DeploymentSampler(server.base_url)
        if version is not None:
            s.note_weight_version(version)
        try:
            (c,) = await s.sample_with_prompt_tokens(PROMPT, max_tokens=12, seed=3, ignore_eos=True, **kw)
            return c
        finally:
            await s.close()

    return loop.run_until_complete(go())


def perturb(model, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen) * p.std().clamp_min(1e-3))


@needs_vllm
def test_a_distributed_push_over_gloo_serves_the_new_weights_in_place(server, group, hf, loop):
    """Every tensor changes (the tied embedding too); after the push vLLM's logprobs are those of the new weights,
    its version is the pushed one, and the weights came in several buckets of the served dtype (fp32 on CPU)."""
    before = sample(server, loop, temperature=1.0)
    perturb(hf, 0.5, seed=1)
    out = loop.run_until_complete(group.push(saved_weights(hf), 1))
    print(
        f"\nvLLM distributed push: {out['total_s']:.2f} s (broadcast {out['broadcast_s']:.2f} s), "
        f"{out['num_buckets']} buckets, {out['bytes'] / 2**20:.2f} MiB, dtype {out['dtype']}"
    )
    assert out["num_buckets"] > 1 and out["dtype"] == "float32"
    answer = out["servers"][server.base_url]
    assert answer["weight_version"] == 1 and answer["received_bytes"] == out["bytes"]
    assert loop.run_until_complete(server.server_weight_version()) == "1"
    after = sample(server, loop, version=1, temperature=1.0)
    assert after.weight_version == 1
    assert (
        after.output_tokens != before.output_tokens
        or max_diff(after.inference_logprobs, before.inference_logprobs) > 1e-2
    )
    diff = max_diff(after.inference_logprobs, hf_logprobs(hf, after.full_tokens, after.prompt_len))
    print(f"after the push: max |vLLM - transformers(new weights)| logprob = {diff:.2e}")
    assert diff < LOGPROB_TOL, "vLLM does not compute with the pushed weights"


@needs_vllm
def test_a_push_vllm_refuses_moves_nothing_and_names_the_tensor(server, group, hf, loop):
    before = sample(server, loop, temperature=0.0)
    bad = [(("model.not_a_layer.weight" if i == 3 else n), t) for i, (n, t) in enumerate(saved_weights(hf))]
    with pytest.raises(WeightSyncError, match="model.not_a_layer.weight"):
        loop.run_until_complete(group.push(bad, 2))
    assert loop.run_until_complete(server.server_weight_version()) == "1"  # kept, and the server was resumed
    again = sample(server, loop, temperature=0.0)
    assert (
        again.output_tokens == before.output_tokens
        and max_diff(again.inference_logprobs, before.inference_logprobs) < 1e-6
    )


@needs_vllm
def test_the_group_pushes_again_after_a_refusal(server, group, hf, loop):
    perturb(hf, 0.3, seed=2)
    out = loop.run_until_complete(group.push(saved_weights(hf), 2))
    assert out["servers"][server.base_url]["weight_version"] == 2
    c = sample(server, loop, version=2, temperature=0.7)
    assert max_diff(c.inference_logprobs, hf_logprobs(hf, c.full_tokens, c.prompt_len, 0.7)) < LOGPROB_TOL
