"""SGLang adapter: request building and response parsing against the shapes in SGLang's docs
(served by a small fake server), and a real-server test that runs only on a GPU machine.

Real server (GPU): set ``SGLANG_BASE_URL`` (and ``SGLANG_MODEL_PATH``, the folder it serves) to
attach, or have ``sglang`` and CUDA importable to launch one; see training/deployment/README.md.
"""

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from aiohttp import web

from training.deployment.client import DeploymentRequestError
from training.deployment.backends.sglang import (
    SGLangDeployment,
    SGLangSampler,
    build_generate_request,
    distributed_init_body,
    distributed_update_body,
    parse_generate_item,
)
from training.deployment.weights.files import WeightSyncError
from training.utils import DeployConfig, EngineConfig


def answer(ids, lps, finish=None, version="default", text="x"):
    """One ``/generate`` answer as SGLang documents it (``return_logprob: true``)."""
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": "abc",
            "finish_reason": finish or {"type": "length", "length": len(ids)},
            "prompt_tokens": 3,
            "completion_tokens": len(ids),
            "cached_tokens": 2,
            "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
        },
    }


def test_request_maps_openai_names_and_seeds_each_copy():
    body = build_generate_request(
        [1, 2, 3], 2, {"max_tokens": 8, "temperature": 0.7, "stop": "\n", "seed": 10, "logprobs": 0, "top_p": None}
    )
    assert body["input_ids"] == [[1, 2, 3], [1, 2, 3]] and body["return_logprob"] is True
    assert body["sampling_params"][0] == {"max_new_tokens": 8, "temperature": 0.7, "stop": ["\n"], "sampling_seed": 10}
    assert body["sampling_params"][1]["sampling_seed"] == 11


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: build_generate_request([1], 1, {"best_of": 2}), "^sampling: 'best_of' has no SGLang equivalent"),
        (lambda: build_generate_request([], 1, {}), "^prompt_ids:"),
        (lambda: build_generate_request([1], 0, {}), "^n:"),
        (lambda: distributed_init_body("h", 1, 1), "^world_size:"),
    ],
)
def test_bad_requests_name_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_parse_answer_to_completion():
    c = parse_generate_item([1, 2, 3], answer([7, 8], [-0.5, -1.5], {"type": "stop", "matched": 8}, "4"))
    assert (c.full_tokens, c.prompt_len, c.inference_logprobs) == ([1, 2, 3, 7, 8], 3, [-0.5, -1.5])
    assert (c.finish_reason, c.weight_version, c.cached_tokens, c.text) == ("stop", 4, 2, "x")
    # SGLang's version is a string, "default" before any update: fall back to the version noted at send time.
    assert parse_generate_item([1], answer([7], [-0.1]), sent_under=6).weight_version == 6


@pytest.mark.parametrize(
    "item, match",
    [
        ({"text": ""}, "no meta_info"),
        ({"meta_info": {"finish_reason": {"type": "stop"}}}, "output_token_logprobs"),
        (answer([7], [-0.1], {"type": "timeout"}), "finish_reason"),
        ({**answer([7], [-0.1]), "output_ids": [9]}, "disagree"),
    ],
)
def test_malformed_answers_raise_with_the_reason(item, match):
    with pytest.raises(DeploymentRequestError, match=match):
        parse_generate_item([1], item)


class FakeSGLang:
    """Serves /generate, /health and the weight endpoints with SGLang's documented shapes."""

    def __init__(self, refuse=False):
        self.requests: list[tuple[str, dict]] = []
        self.refuse = refuse
        self.version = "default"

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/get_weight_version", self.get_version)
        for path in ("/update_weights_from_disk", "/pause_generation", "/continue_generation"):
            app.router.add_post(path, self.control)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()

    async def get_version(self, request):
        return web.json_response({"weight_version": self.version})

    async def generate(self, request):
        body = await request.json()
        self.requests.append(("/generate", body))
        batch = isinstance(body["input_ids"][0], list)
        outs = [
            answer(
                [20 + i, 2],
                [-0.25, -0.75],
                {"type": "stop", "matched": 2},
                self.version,
                text='<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
            )
            for i in range(len(body["input_ids"]) if batch else 1)
        ]
        return web.json_response(outs if batch else outs[0])

    async def control(self, request):
        body = await request.json()
        self.requests.append((request.path, body))
        if request.path == "/update_weights_from_disk":
            if self.refuse:
                return web.json_response({"success": False, "message": "shape mismatch for lm_head.weight"})
            self.version = body["weight_version"]
            return web.json_response(
                {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
            )
        return web.json_response({})


def test_sampler_over_generate_and_chat(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)

    async def scenario():
        async with FakeSGLang() as fake:
            s = SGLangSampler(fake.url, tokenizer=tok).with_defaults(max_tokens=4, temperature=1.0)
            cs = await s.sample_with_prompt_tokens([1, 2, 3], n=2, seed=5)
            chat = await s.chat(
                [{"role": "user", "content": "hi"}],
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            )
            await s.close()
            return fake.requests, cs, chat

    requests, cs, (chat,) = asyncio.run(scenario())
    assert [c.output_tokens for c in cs] == [[20, 2], [21, 2]] and cs[0].inference_logprobs == [-0.25, -0.75]
    assert requests[0][1]["sampling_params"][1] == {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 6}
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tokenize=True,
        return_dict=False,
    )
    assert requests[1][1]["input_ids"] == [list(rendered)] and chat.prompt_tokens == list(rendered)
    assert chat.finish_reason == "tool_calls" and chat.tool_calls[0]["function"]["name"] == "f"


def test_chat_without_tokenizer_says_what_is_missing():
    with pytest.raises(ValueError, match="^tokenizer:"):
        asyncio.run(SGLangSampler("http://127.0.0.1:9").chat([{"role": "user", "content": "hi"}]))


def test_weight_push_writes_a_folder_and_posts_update_weights_from_disk(tiny_model_path, tmp_path):
    weights = [("model.embed_tokens.weight", torch.ones(4, 2)), ("model.norm.weight", torch.ones(2))]

    async def scenario(refuse):
        async with FakeSGLang(refuse=refuse) as fake:
            # not .start(): its blocking health check would wait on this very event loop
            dep = SGLangDeployment(tiny_model_path, DeployConfig(engine="sglang", base_url=fake.url))
            try:
                out = await dep.push_weights(
                    weights, 5, mode="disk", directory=str(tmp_path / f"w{refuse}"), wait_for_inflight=refuse
                )
            finally:
                dep.stop()
            return fake.requests, out

    requests, out = asyncio.run(scenario(False))
    paths = [p for p, _ in requests]
    assert paths == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    body = requests[1][1]
    folder = Path(out["path"]).parent  # out["path"] is the weights file
    assert body["model_path"] == str(folder) and body["weight_version"] == "5"
    assert {p.name for p in folder.iterdir()} >= {"model.safetensors", "config.json"}
    with pytest.raises(WeightSyncError, match="shape mismatch for lm_head.weight"):
        asyncio.run(scenario(True))


def test_launch_command_and_distributed_bodies():
    dep = SGLangDeployment(
        "/m", DeployConfig(engine="sglang", engine_args=["--tp", "2"], engine_config=EngineConfig(max_model_len=1024))
    )
    dep.port = 30000
    cmd = dep._command()
    assert cmd[1:5] == ["-m", "sglang.launch_server", "--model-path", "/m"]
    assert cmd[cmd.index("--port") + 1] == "30000" and cmd[cmd.index("--context-length") + 1] == "1024"
    assert cmd[-2:] == ["--tp", "2"]
    assert "--random-seed" not in cmd  # no seed set: SGLang's own default
    seeded = SGLangDeployment("/m", DeployConfig(engine="sglang", engine_config=EngineConfig(seed=7)))._command()
    assert seeded[seeded.index("--random-seed") + 1] == "7"
    assert distributed_init_body("10.0.0.1", 29500, 3)["rank_offset"] == 1
    body = distributed_update_body([("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16))], 7)
    assert (body["names"], body["dtypes"], body["shapes"], body["weight_version"]) == (
        ["a.weight"],
        ["bfloat16"],
        [[2, 3]],
        "7",
    )


# ----------------------------------------------------------------------- real SGLang (GPU only)
def _sglang_reason():
    if os.environ.get("SGLANG_BASE_URL"):
        return None
    try:
        import sglang  # noqa: F401
    except ImportError:
        return "needs a GPU machine: set SGLANG_BASE_URL (+ SGLANG_MODEL_PATH) or install sglang with CUDA"
    return None if torch.cuda.is_available() else "sglang is installed but CUDA is not available"


@pytest.mark.gpu
@pytest.mark.skipif(_sglang_reason() is not None, reason=str(_sglang_reason()))
def test_real_server(tmp_path):
    """Sample token-level, push new weights from disk, see the version and the outputs change."""
    from transformers import AutoModelForCausalLM

    from training.models.build_tiny import build_tiny
    from training.utils.cache import cache_dir

    model_path = os.environ.get("SGLANG_MODEL_PATH")
    if model_path is None:
        model_path = str(cache_dir() / "tiny-qwen3-h256")
        if not (Path(model_path) / "config.json").exists():
            build_tiny(model_path, hidden=256)  # head_dim 64
    cfg = DeployConfig(engine="sglang", base_url=os.environ.get("SGLANG_BASE_URL"), startup_timeout_s=600)

    async def scenario(dep):
        s = SGLangSampler(dep.base_url)
        (before,) = await s.sample_with_prompt_tokens([5, 6, 7], max_tokens=8, temperature=0.0, ignore_eos=True)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        weights = [
            (k, v + 0.5 * v.std() * torch.randn_like(v)) for k, v in model.state_dict().items() if k != "lm_head.weight"
        ]
        await dep.push_weights(weights, 1, mode="disk", directory=str(tmp_path / "w"))
        (after,) = await s.sample_with_prompt_tokens([5, 6, 7], max_tokens=8, temperature=0.0, ignore_eos=True)
        await s.close()
        return before, after

    with SGLangDeployment(model_path, cfg, log_file=str(tmp_path / "sglang.log")) as dep:
        before, after = asyncio.run(scenario(dep))
    assert len(before.output_tokens) == 8 and before.finish_reason == "length"
    assert after.weight_version == 1 and after.output_tokens != before.output_tokens
    print(json.dumps({"before": before.output_tokens, "after": after.output_tokens}))
