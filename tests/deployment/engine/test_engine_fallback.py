"""The transformers fallback (architectures without a lean forward) batches its decode steps.

Tiny random GPT-2 (learned absolute positions) and Mistral (sliding-window attention, window 8,
shorter than the sequences) are built offline with the tiny tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.deployment.engine.test_engine import PROMPTS, greedy, hf_logprobs, run_engine

LENGTHS = [16, 9, 23, 12]


def _save(out, cfg, tokenizer_path: str) -> str:
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def fallback_model(request, tmp_path_factory, tiny_model_path) -> str:
    from transformers import GPT2Config, MistralConfig

    vocab = len(AutoTokenizer.from_pretrained(tiny_model_path))
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=512)
    else:
        cfg = MistralConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            max_position_embeddings=512,
        )
    return _save(out, cfg, tiny_model_path)


@pytest.mark.parametrize("fallback_model", ["gpt2", "mistral-sliding-window"], indirect=True)
def test_fallback_batches_decode_and_matches_serial_and_transformers(fallback_model):
    async def batched(eng):
        res = await asyncio.gather(*[eng.generate(p, greedy(n)) for p, n in zip(PROMPTS, LENGTHS)])
        return res, eng.stats(), type(eng.engine.runner).__name__

    async def serial(eng):
        return [await eng.generate(p, greedy(n)) for p, n in zip(PROMPTS, LENGTHS)]

    (together, stats, runner), alone = run_engine(fallback_model, batched), run_engine(fallback_model, serial)
    assert runner == "HFModelRunner"
    model_type = "gpt2" if "gpt2" in fallback_model else "mistral"
    assert stats["execution_path"] == "hf_fallback"  # chosen by build_runner, and said why
    assert f"model_type {model_type!r} is not one of" in stats["execution_path_reason"]
    assert stats["max_running"] > 1 and stats["steps"] < sum(LENGTHS) / 2  # one forward per step, not per row
    model = AutoModelForCausalLM.from_pretrained(fallback_model, dtype=torch.float32).eval()
    for prompt, n, a, b in zip(PROMPTS, LENGTHS, together, alone):
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert a.output_token_ids == ref
        assert torch.allclose(torch.tensor(a.output_logprobs), hf_logprobs(model, prompt, ref), atol=1e-4)


@pytest.mark.parametrize("fallback_model", ["gpt2"], indirect=True)
def test_fallback_shares_cached_prefixes(fallback_model):
    async def body(eng):
        first = await asyncio.gather(*[eng.generate(PROMPTS[2], greedy(8)) for _ in range(4)])
        turn2 = await eng.generate(PROMPTS[2] + first[0].output_token_ids + [5], greedy(8))
        return first, turn2, eng.stats()

    first, turn2, stats = run_engine(fallback_model, body)
    assert len({tuple(r.output_token_ids) for r in first}) == 1
    assert stats["prefill_tokens"] <= len(PROMPTS[2]) + 3 + 1
    assert turn2.cached_prompt_tokens == len(PROMPTS[2]) + 8 - 1
    model = AutoModelForCausalLM.from_pretrained(fallback_model, dtype=torch.float32).eval()
    prompt = PROMPTS[2] + first[0].output_token_ids + [5]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, len(prompt) :
    ].tolist()
    assert turn2.output_token_ids == ref


def test_a_cached_hub_id_resolves_to_its_snapshot_folder_and_takes_the_lean_forward(tmp_path, tiny_model_path):
    """A Hugging Face cache (the real layout: ``models--org--name/refs/main`` naming a snapshot folder) built in
    tmp_path and named by HF_HUB_CACHE, holding the tiny model: the hub id resolves to the snapshot folder and
    the engine runs the lean forward, not the transformers fallback; an id that is not cached comes back as is
    (whoever loads it downloads it, as before). In a child process: huggingface_hub reads HF_HUB_CACHE at import."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--test-org--tiny-qwen3"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_model_path, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    script = """
import json
import logging
logging.basicConfig(level=logging.INFO)
from training.deployment.engine.engine import LLMEngine
from training.utils.cache import local_model_path
from training.utils.config import EngineConfig

engine = LLMEngine(EngineConfig(model="test-org/tiny-qwen3", max_batch_size=2, max_model_len=64))
print(json.dumps({
    "model_path": engine.model_path,
    "path": engine.execution_path.name,
    "runner": type(engine.runner).__name__,
    "missing": local_model_path("test-org/not-in-the-cache"),
}))
"""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["model_path"]).resolve() == snapshot.resolve()
    assert out["runner"] == "LeanModelRunner" and out["path"] in ("native", "torch")
    assert out["missing"] == "test-org/not-in-the-cache"
    assert "engine path: " in proc.stderr
