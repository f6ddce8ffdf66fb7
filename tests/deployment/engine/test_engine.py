"""The generation engine against transformers, and its batching / session / weight / pause contracts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.deployment.engine import AsyncEngine, EngineConfig, EngineError, SamplingParams, WeightUpdateError
from training.deployment.engine.weights import load_safetensors

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 3], [42] * 20, [300, 301, 302, 303, 7, 8, 9, 10, 11, 12, 13]]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def make_engine(path: str, **kw) -> AsyncEngine:
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("max_model_len", 256)
    return AsyncEngine(EngineConfig(model=path, **kw))


def require_native() -> None:
    """Skip unless the native decode step builds here (it needs a C compiler; CI machines have gcc)."""
    from training.deployment.engine.runners.native import native_available

    reason = native_available(torch.device("cpu"), torch.float32)
    if reason is not None:
        pytest.skip(reason)


def kv_bytes(path: str, blocks: int, block_size: int = 16) -> int:
    """``kv_cache_memory_bytes`` of a pool of ``blocks`` KV blocks for the fp32 model at ``path``."""
    from transformers import AutoConfig

    from training.deployment.engine.kv_cache import bytes_per_block

    cfg = AutoConfig.from_pretrained(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_block = bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads, block_size, head_dim, torch.float32)
    return blocks * per_block


def row_tables(runner, rows: list[int], length: int) -> list[list[int]]:
    """Block tables for runner-level tests: row ``r`` gets its own zeroed blocks ``[r n, (r + 1) n)`` (n = the blocks
    of ``length`` positions), as the block manager would hand them out."""
    n = -(-length // runner.cache.block_size)
    tables = [list(range(r * n, (r + 1) * n)) for r in rows]
    assert max(max(t) for t in tables) < runner.cache.num_blocks, "the runner's pool is too small for these rows"
    for t in tables:
        for b in t:
            runner.cache.zero_block(b)
    return tables


def run_engine(path: str, body, **kw):
    """Start an engine on ``path``, await ``body(engine)``, shut it down; returns body's value."""

    async def main():
        eng = make_engine(path, **kw)
        await eng.start()
        try:
            return await body(eng)
        finally:
            await eng.shutdown()

    return asyncio.run(main())


def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Logprob of each output token under the transformers forward (logits / temperature)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(output)[:, None]).squeeze(1)


@pytest.fixture(scope="module")
def tiny_qwen2_path(tmp_path_factory, tiny_model_path) -> str:
    """A small random Qwen2 (qkv bias, untied head) with the tiny tokenizer; biases randomised."""
    from transformers import Qwen2Config

    out = tmp_path_factory.mktemp("qwen2")
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=1000.0,
        eos_token_id=tok.eos_token_id,
    )
    return save_random_model(cfg, tok, out, seed=1)


def save_random_model(cfg, tok, out, seed: int) -> str:
    """A random-init model of ``cfg`` with its biases randomised too (init leaves them 0), saved with ``tok``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def hf_qwen3(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "qwen3-transformers-fallback"])
@pytest.mark.usefixtures("tiny_model_path")  # getfixturevalue picks each case's model
def test_greedy_matches_hf_generate_and_logprobs_match_forward(arch, request):
    path = request.getfixturevalue(
        {"qwen3": "tiny_model_path", "llama": "tiny_llama_path", "qwen2": "tiny_qwen2_path"}.get(
            arch, "tiny_model_path"
        )
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    async def body(eng):
        return await asyncio.gather(*[eng.generate(p, greedy(16)) for p in PROMPTS])

    results = run_engine(path, body, use_lean_forward=not arch.endswith("fallback"))
    for prompt, res in zip(PROMPTS, results):
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert res.output_token_ids == ref
        lp = hf_logprobs(model, prompt, res.output_token_ids)
        assert torch.allclose(torch.tensor(res.output_logprobs), lp, atol=1e-4)
        assert res.finish_reason == "length" and res.weight_version == 0


def test_32_concurrent_requests_run_batched_with_correct_lengths(tiny_model_path, hf_qwen3):
    lengths = [1 + (7 * i) % 29 for i in range(32)]
    prompts = [[(13 * i + j) % 500 + 3 for j in range(1 + (5 * i) % 17)] for i in range(32)]

    async def body(eng):
        res = await asyncio.gather(*[eng.generate(p, greedy(n)) for p, n in zip(prompts, lengths)])
        return res, eng.stats()

    results, stats = run_engine(tiny_model_path, body, max_batch_size=32)
    assert [len(r.output_token_ids) for r in results] == lengths
    assert all(r.finish_reason == "length" and len(r.output_logprobs) == len(r.output_token_ids) for r in results)
    assert stats["max_running"] > 1 and stats["steps"] < sum(lengths) / 2
    for i in (0, 5, 17, 31):  # batched (and gap-slotted) rows decode exactly like a lone sequence
        ref = hf_qwen3.generate(
            torch.tensor([prompts[i]]), max_new_tokens=lengths[i], do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompts[i]) :].tolist()
        assert results[i].output_token_ids == ref


def test_seeded_sampling_reproducible_regardless_of_concurrent_traffic(tiny_model_path):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)

    async def body(eng):
        alone = await eng.generate(PROMPTS[0], params)
        noise = [eng.generate(p, SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)) for p in PROMPTS * 3]
        crowded, *_ = await asyncio.gather(eng.generate(PROMPTS[0], params), *noise)
        other = await eng.generate(PROMPTS[0], SamplingParams(max_tokens=24, seed=99, ignore_eos=True))
        return alone, crowded, other

    alone, crowded, other = run_engine(tiny_model_path, body, max_batch_size=16)
    assert alone.output_token_ids == crowded.output_token_ids
    assert alone.output_logprobs == pytest.approx(crowded.output_logprobs, abs=1e-5)
    assert other.output_token_ids != alone.output_token_ids


def test_logprob_is_under_temperature_scaled_full_distribution(tiny_model_path, hf_qwen3):
    async def body(eng):
        hot = await eng.generate(PROMPTS[1], SamplingParams(max_tokens=10, temperature=0.7, seed=3, ignore_eos=True))
        # a tiny nucleus keeps only the top token: greedy tokens, but logprobs before truncation
        narrow = await eng.generate(
            PROMPTS[1], SamplingParams(max_tokens=10, temperature=0.7, top_p=1e-6, seed=3, ignore_eos=True)
        )
        cold = await eng.generate(PROMPTS[1], greedy(10))
        return hot, narrow, cold

    hot, narrow, cold = run_engine(tiny_model_path, body)
    for res in (hot, narrow):
        lp = hf_logprobs(hf_qwen3, PROMPTS[1], res.output_token_ids, temperature=0.7)
        assert torch.allclose(torch.tensor(res.output_logprobs), lp, atol=1e-4)
    assert narrow.output_token_ids == cold.output_token_ids
    assert all(lp < 0 for lp in narrow.output_logprobs)


def test_stop_token_ids_and_stop_strings_end_output(tiny_model_path):
    async def body(eng):
        full = await eng.generate(PROMPTS[3], greedy(20))
        stop_tok = full.output_token_ids[4]
        by_id = await eng.generate(PROMPTS[3], greedy(20, stop_token_ids=[stop_tok]))
        stop_str = full.text[3:5]
        by_str = await eng.generate(PROMPTS[3], greedy(20, stop=[stop_str]))
        return full, stop_tok, by_id, stop_str, by_str

    full, stop_tok, by_id, stop_str, by_str = run_engine(tiny_model_path, body)
    first = full.output_token_ids.index(stop_tok)
    assert by_id.finish_reason == "stop"
    assert by_id.output_token_ids == full.output_token_ids[: first + 1]
    assert by_str.finish_reason == "stop"
    assert by_str.text == full.text[: full.text.find(stop_str)]
    assert stop_str not in by_str.text
    assert by_str.output_token_ids == full.output_token_ids[: len(by_str.output_token_ids)]
    assert len(by_str.output_token_ids) < len(full.output_token_ids)


def test_a_stop_string_late_in_a_long_output_is_found(tiny_model_path):
    """The stop check decodes only the newest tokens; a match 150+ tokens in is still cut exactly."""

    def sampled(**kw):  # seeded sampling: varied text, the same tokens on both calls
        return SamplingParams(max_tokens=200, temperature=1.0, seed=7, ignore_eos=True, **kw)

    async def body(eng):
        full = await eng.generate(PROMPTS[1], sampled())
        k = next(i for i in range(len(full.text) - 20, 0, -1) if full.text.find(full.text[i : i + 6]) == i)
        stop_str = full.text[k : k + 6]  # the latest 6 characters that occur there first
        return full, stop_str, await eng.generate(PROMPTS[1], sampled(stop=[stop_str]))

    full, stop_str, by_str = run_engine(tiny_model_path, body)
    assert by_str.finish_reason == "stop"
    assert by_str.text == full.text[: full.text.find(stop_str)]
    assert len(by_str.output_token_ids) > 100


def test_eos_stops_unless_ignore_eos(tiny_model_path):
    async def body(eng):
        full = await eng.generate(PROMPTS[0], greedy(10))
        eng.engine.eos_token_ids = [full.output_token_ids[2]]  # pretend that token is the model's eos
        stopped = await eng.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0))
        ignored = await eng.generate(PROMPTS[0], greedy(10))
        return full, stopped, ignored

    full, stopped, ignored = run_engine(tiny_model_path, body)
    first = full.output_token_ids.index(full.output_token_ids[2])
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == full.output_token_ids[: first + 1]  # the eos token is kept
    assert ignored.output_token_ids == full.output_token_ids and ignored.finish_reason == "length"


def test_session_reuses_parked_kv_and_matches_cold_run(tiny_model_path):
    async def body(eng):
        first = await eng.generate(PROMPTS[3], greedy(8), session_id="s1")
        parked = eng.stats()["parked_sessions"]
        turn2 = PROMPTS[3] + first.output_token_ids + [11, 12, 13]
        warm = await eng.generate(turn2, greedy(10), session_id="s1")
        diverged = turn2[:6] + [400, 401]  # shares only a 6-token prefix with the parked tokens
        partial = await eng.generate(diverged, greedy(10), session_id="s1")
        return first, parked, turn2, warm, diverged, partial

    first, parked, turn2, warm, diverged, partial = run_engine(tiny_model_path, body)

    async def cold_body(eng):
        return await eng.generate(turn2, greedy(10)), await eng.generate(diverged, greedy(10))

    cold, cold_div = run_engine(tiny_model_path, cold_body)
    assert parked == 1 and first.cached_prompt_tokens == 0
    assert warm.cached_prompt_tokens == len(PROMPTS[3]) + len(first.output_token_ids) - 1
    assert warm.output_token_ids == cold.output_token_ids
    assert warm.output_logprobs == pytest.approx(cold.output_logprobs, abs=1e-5)
    assert partial.cached_prompt_tokens == 6
    assert partial.output_token_ids == cold_div.output_token_ids


def test_parked_sessions_evicted_lru_when_blocks_run_out(tiny_model_path):
    """A pool of 4 blocks of 16 tokens: three parked turns take 1, 1 and 2 blocks; a fourth request needs one:
    the least recently parked session (s0) gives its block up, s2 keeps both of its own."""

    async def body(eng):
        outs = [await eng.generate(PROMPTS[i], greedy(4), session_id=f"s{i}") for i in range(3)]
        assert eng.stats()["kv_cache"]["blocks_free"] == 0 and eng.stats()["parked_sessions"] == 3
        await eng.generate(PROMPTS[3], greedy(4))  # needs a block: evicts s0, the least recent
        again = [
            await eng.generate(PROMPTS[i] + outs[i].output_token_ids + [1], greedy(4), session_id=f"s{i}")
            for i in (0, 2)
        ]
        return again

    again0, again2 = run_engine(
        tiny_model_path, body, max_batch_size=3, kv_cache_memory_bytes=kv_bytes(tiny_model_path, 4), kv_block_size=16
    )
    assert again0.cached_prompt_tokens == 0
    assert again2.cached_prompt_tokens == len(PROMPTS[2]) + 4 - 1


def _perturbed(path: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: t + 0.5 * torch.randn(t.shape, generator=g) for n, t in load_safetensors(path).items()}


def test_update_weights_changes_output_bumps_version_and_drops_sessions(tiny_model_path):
    async def body(eng):
        before = await eng.generate(PROMPTS[0], greedy(12), session_id="s")
        await eng.update_weights(_perturbed(tiny_model_path), weight_version=1)
        stats = eng.stats()
        after = await eng.generate(PROMPTS[0] + before.output_token_ids, greedy(12), session_id="s")
        await eng.update_weights_from_disk(tiny_model_path, weight_version=2)
        restored = await eng.generate(PROMPTS[0], greedy(12))
        return before, stats, after, restored, eng.weight_version

    before, stats, after, restored, version = run_engine(tiny_model_path, body)
    assert stats["parked_sessions"] == 0 and stats["weight_version"] == 1
    assert after.weight_version == 1 and after.cached_prompt_tokens == 0
    assert restored.output_token_ids == before.output_token_ids and restored.weight_version == 2 == version

    async def check_changed(eng):
        await eng.update_weights(_perturbed(tiny_model_path), weight_version=5)
        return await eng.generate(PROMPTS[0], greedy(12))

    assert run_engine(tiny_model_path, check_changed).output_token_ids != before.output_token_ids


@pytest.mark.parametrize("breakage", ["missing", "shape", "extra", "tied-head-differs"])
def test_bad_weight_update_refused_whole_and_old_weights_stay(tiny_model_path, breakage):
    tensors = _perturbed(tiny_model_path)
    victim = "model.layers.1.mlp.up_proj.weight"
    if breakage == "missing":
        del tensors[victim]
    elif breakage == "shape":
        tensors[victim] = tensors[victim][:, :-1]
    elif breakage == "extra":
        tensors["model.layers.9.mlp.up_proj.weight"] = tensors[victim]
    else:
        tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])

    async def body(eng):
        before = await eng.generate(PROMPTS[1], greedy(10))
        with pytest.raises(WeightUpdateError) as err:
            await eng.update_weights(tensors, weight_version=1)
        after = await eng.generate(PROMPTS[1], greedy(10))
        return before, after, str(err.value)

    before, after, message = run_engine(tiny_model_path, body)
    assert after.output_token_ids == before.output_token_ids and after.weight_version == 0
    assert ("lm_head.weight" if breakage == "tied-head-differs" else "up_proj") in message


def test_tied_head_in_update_accepted_when_equal(tiny_model_path):
    tensors = dict(load_safetensors(tiny_model_path))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    async def body(eng):
        await eng.update_weights(tensors, weight_version=3)
        return eng.weight_version

    assert run_engine(tiny_model_path, body) == 3


@pytest.mark.parametrize("wait", [True, False])
def test_update_during_generation_respects_wait_for_inflight(tiny_model_path, wait):
    async def body(eng):
        ref = await eng.generate(PROMPTS[2], greedy(150))
        task = asyncio.create_task(eng.generate(PROMPTS[2], greedy(150)))
        while eng.stats()["tokens_generated"] < 152:
            await asyncio.sleep(0.001)
        await eng.update_weights(_perturbed(tiny_model_path), weight_version=1, wait_for_inflight=wait)
        done_before_update = task.done()
        return ref, await task, done_before_update

    ref, res, done_before_update = run_engine(tiny_model_path, body)
    if wait:  # finished entirely under the old weights before the swap
        assert done_before_update and res.weight_version == 0 and res.output_token_ids == ref.output_token_ids
    else:  # swapped mid-sequence: it continues under the new weights, labelled by its oldest token
        assert res.weight_version == 0 and len(res.output_token_ids) == 150
        assert res.token_weight_versions[0] == 0 and res.token_weight_versions[-1] == 1
        assert res.output_token_ids != ref.output_token_ids


def test_pause_holds_requests_and_resume_releases_them(tiny_model_path):
    async def body(eng):
        await eng.pause()
        task = asyncio.create_task(eng.generate(PROMPTS[0], greedy(5)))
        await asyncio.sleep(0.3)
        held = (task.done(), eng.stats()["steps"], eng.stats()["waiting"])
        await eng.resume()
        res = await asyncio.wait_for(task, 30)
        return held, res

    (done, steps, waiting), res = run_engine(tiny_model_path, body)
    assert not done and steps == 0 and waiting == 1
    assert len(res.output_token_ids) == 5


def test_an_engine_out_of_work_gives_freed_heap_pages_back(tiny_model_path):
    """On CPU the engine thread trims glibc's heap when it goes idle with its RSS grown by over IDLE_TRIM_BYTES:
    100 MiB freed in the middle of the heap (what a burst's activations leave) stops being resident."""
    from training.deployment.engine.async_engine import IDLE_TRIM_BYTES
    from training.deployment.server.process_stats import heap_bytes, rss_bytes

    if rss_bytes() is None or heap_bytes()[0] is None:
        pytest.skip("needs /proc and glibc")

    async def body(eng):
        await eng.generate(PROMPTS[0], greedy(2))  # the engine thread has trimmed once and sleeps
        chunks = [bytearray(100 * 1024) for _ in range(1024)]  # 100 MiB of heap chunks (below the mmap threshold)
        keep = chunks[-1]  # the top of the heap stays held, so free() cannot shrink the heap from its end
        del chunks
        grown = rss_bytes()
        await eng.generate(PROMPTS[1], greedy(2))  # work, then idle again: the thread trims before it sleeps
        for _ in range(200):
            if rss_bytes() < grown - IDLE_TRIM_BYTES:
                break
            await asyncio.sleep(0.01)
        return grown, rss_bytes(), len(keep)

    grown, after, _ = run_engine(tiny_model_path, body)
    assert after < grown - IDLE_TRIM_BYTES, f"RSS {grown >> 20} -> {after >> 20} MiB"


def test_shutdown_aborts_pending_and_cancel_frees_blocks(tiny_model_path):
    async def body():
        eng = make_engine(tiny_model_path, max_batch_size=2, max_model_len=4096)
        await eng.start()
        task = asyncio.create_task(eng.generate(PROMPTS[0], greedy(4000)))  # long enough to be running when cancelled
        while eng.stats()["running"] == 0:
            assert not task.done(), "the request ended before it was seen running"  # fail, never spin
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ok = await eng.generate(PROMPTS[1], greedy(3))
        await eng.pause()
        pending = asyncio.create_task(eng.generate(PROMPTS[1], greedy(3)))
        await asyncio.sleep(0.05)
        used = eng.stats()["kv_cache"]["blocks_used"]
        await eng.shutdown()
        return ok, used, await pending

    ok, used, aborted = asyncio.run(body())
    assert len(ok.output_token_ids) == 3 and used == 0  # the cancelled sequence's blocks were released
    assert aborted.finish_reason == "abort" and aborted.output_token_ids == []


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt_token_ids"),
        ([1, 10**6], SamplingParams(), "prompt_token_ids[1]"),
        ([1, -1], SamplingParams(), "prompt_token_ids[1]"),
        ([1] * 250, SamplingParams(max_tokens=7), "max_tokens"),
        ([1], SamplingParams(temperature=-0.1), "temperature"),
        ([1], SamplingParams(top_p=0.0), "top_p"),
        ([1], SamplingParams(top_p=1.5), "top_p"),
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
        ([1], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids[0]"),
    ],
)
def test_bad_requests_raise_engine_error_naming_field(tiny_model_path, prompt, params, field):
    async def body(eng):
        with pytest.raises(EngineError) as err:
            await eng.generate(prompt, params)
        return str(err.value)

    assert run_engine(tiny_model_path, body).startswith(field)


def test_engine_properties(tiny_model_path):
    eng = make_engine(tiny_model_path)
    assert eng.model_name == Path(tiny_model_path).name and eng.max_model_len == 256
    assert eng.vocab_size == len(eng.tokenizer) and eng.eos_token_ids == [eng.tokenizer.eos_token_id]
    assert eng.weight_version == 0 and eng.stats()["running"] == 0


def test_cuda_graph_padded_decode_math_matches_eager_decode(tiny_model_path):
    """The padded, null-block, block-bucketed step a CUDA graph captures gives the eager logits (run on CPU)."""
    from training.deployment.engine.runners.cuda_graphs import CudaGraphDecoder
    from training.deployment.engine.engine import LLMEngine
    from training.deployment.engine.runners.lean import PrefillItem

    eng = LLMEngine(EngineConfig(model=tiny_model_path, max_batch_size=6, max_model_len=300, kv_block_size=16))
    runner = eng.runner
    tables = row_tables(runner, [1, 4, 2], 64)
    runner.prefill([PrefillItem(t, p, 0) for t, p in zip(tables, (PROMPTS[0], PROMPTS[2], PROMPTS[3]))])
    tables[1] = tables[1][:2]  # rows of different widths: padded to the widest with the null block
    tokens = [9, 10, 11]
    positions = [len(PROMPTS[0]), len(PROMPTS[2]), len(PROMPTS[3])]
    graphs = CudaGraphDecoder(runner, (1, 2, 4, 8), max_batch_size=6, max_model_len=300)
    assert graphs.batch_buckets == [1, 2, 4, 6] and graphs.block_buckets == [16, 19]
    padded = graphs.run_without_graph(tables, tokens, positions).clone()
    assert graphs.tables[3, 0] == runner.cache.null_block  # the padding row: null blocks only
    eager = runner.decode(tables, tokens, positions)
    assert padded.shape == eager.shape == (3, eng.vocab_size)
    assert torch.allclose(padded, eager, atol=1e-5)


def test_a_kv_cache_larger_than_memory_fails_early_naming_its_settings():
    import torch

    from training.deployment.engine.kv_cache import KVBudget, KVCache, available_memory_bytes

    assert available_memory_bytes(torch.device("cpu")) > 0
    shape = dict(num_layers=64, num_kv_heads=8, head_dim=128, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(MemoryError, match="kv_cache_memory_bytes"):
        KVCache(budget=KVBudget(memory_bytes=2**50), **shape)  # 1 PiB: refused before allocating
    with pytest.raises(ValueError, match="kv_cache_memory_bytes.*holds no block"):
        KVCache(budget=KVBudget(memory_bytes=1000), **shape)
    small = KVCache(
        num_layers=2,
        budget=KVBudget(block_size=16, memory_bytes=3 * 2 * 16 * 8 * 4),
        num_kv_heads=1,
        head_dim=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert small.num_blocks == 3 and small.k[0].shape == (4, 1, 16, 4)  # 3 blocks and the null block
    fraction = KVBudget(block_size=16, memory_fraction=0.5, max_tokens=100)
    assert fraction.blocks(small.bytes_per_block, torch.device("cpu"))[0] == 7  # capped at 100 tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_onednn_linears_match_plain_matmuls_and_follow_streamed_weight_updates(tiny_qwen2_path, tiny_model_path, dtype):
    """On CPU (fp32, and bf16 where the CPU has it) the lean runner's matmuls run on oneDNN-reordered copies of
    the weights: the logits equal the plain ``F.linear`` path's (Qwen2: biases through both fused forms), and a
    streamed update, which writes ``runner.targets`` piece by piece, refreshes the copies (otherwise the old
    weights would keep generating)."""
    from training.deployment.engine.engine import LLMEngine
    from training.deployment.engine.runners.lean import PrefillItem

    def logits(runner, onednn: bool) -> torch.Tensor:
        if not onednn:  # the plain path on the same tensors
            runner.matmul = "torch"
        try:
            tables = row_tables(runner, [0, 1], 32)
            first = runner.prefill([PrefillItem(tables[0], PROMPTS[3], 0), PrefillItem(tables[1], PROMPTS[0], 0)])
            first = first.clone()
            step = runner.decode(tables, [7, 8], [len(PROMPTS[3]), len(PROMPTS[0])]).clone()
            return torch.cat([first, step])
        finally:
            runner.matmul = "onednn"

    config = EngineConfig(model=tiny_qwen2_path, max_batch_size=4, max_model_len=64, dtype=dtype, decode_kernel="torch")
    runner = LLMEngine(config).runner  # the torch step: with the native one the prefill's matmuls are its own
    if not runner.onednn:
        pytest.skip(f"no oneDNN linears for {dtype} here (torch without mkldnn, or a CPU without bf16)")
    assert runner.lm_head_packed is not None and all("qkv_packed" in L for L in runner.layers)
    tol = 1e-5 if dtype == "float32" else 2e-2  # bf16: the same oneDNN kernels as F.linear, rounding of the fused add
    torch.testing.assert_close(logits(runner, True), logits(runner, False), atol=tol, rtol=tol)

    async def body(eng):
        await eng.generate(PROMPTS[3], greedy())  # the engine thread is idle again once this returns
        before = logits(eng.engine.runner, True)
        new = {name: t * 1.5 if t.ndim == 2 else t for name, t in load_safetensors(eng.config.model).items()}

        def load():
            for name, target in eng.engine.runner.targets.items():
                target.copy_(new[name])

        await eng.update_weights_streamed(load, 1)
        after = logits(eng.engine.runner, True)
        torch.testing.assert_close(after, logits(eng.engine.runner, False), atol=tol, rtol=tol)
        return before, after

    before, after = run_engine(tiny_model_path, body, dtype=dtype, decode_kernel="torch")
    assert not torch.allclose(before, after, atol=1e-3)  # the copies follow the update


def test_decode_attention_equals_sdpa_over_rows_of_any_length():
    """The two-matmul decode attention (fp32 CPU) gives SDPA's output, rows masked to their own lengths;
    other dtypes go to SDPA itself."""
    import torch.nn.functional as F

    from training.deployment.engine.runners.lean import decode_attention

    torch.manual_seed(0)
    rows, kh, g, d, keys = 9, 3, 3, 64, 300
    q, k, v = torch.randn(rows, kh, g, d), torch.randn(rows, kh, keys, d), torch.randn(rows, kh, keys, d)
    lengths = torch.tensor([1, 2, 17, 64, 150, 299, 300, 5, 256])
    visible = torch.arange(keys)[None, :] < lengths[:, None]
    mask = torch.zeros(rows, keys).masked_fill_(~visible, float("-inf"))[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(decode_attention(q, k, v, mask), want, atol=1e-6)
    # a row attends only to its own visible keys: the first row's output is its first value
    assert torch.allclose(decode_attention(q, k, v, mask)[0], v[0, :, :1].expand(kh, g, d), atol=1e-6)
    half = [t.bfloat16() for t in (q, k, v, mask)]
    assert torch.equal(decode_attention(*half), F.scaled_dot_product_attention(*half[:3], attn_mask=half[3]))
