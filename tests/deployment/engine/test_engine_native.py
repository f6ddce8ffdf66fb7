"""The native (C) decode step: same logits and K/V as the torch step, its matmul, its build and its fallbacks."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from training.deployment.engine.kv_cache import KVBudget
from training.deployment.engine.runners.lean import LeanModelRunner, PrefillItem, SharedPrefix
from training.deployment.engine.runners.native import GEMM_MIN_ROWS
from tests.deployment.engine.test_engine import (  # noqa: F401 (tiny_qwen2_path: a fixture)
    greedy,
    require_native,
    row_tables,
    run_engine,
    save_random_model,
    tiny_qwen2_path,
)

pytestmark = pytest.mark.usefixtures("native")


@pytest.fixture
def native():
    require_native()


@pytest.fixture(scope="module")
def odd_llama_path(tmp_path_factory, tiny_model_path) -> str:
    """A Llama with biases on every projection, head_dim 24 (not a multiple of 16: the scalar attention) and
    projection widths that are not multiples of 32 (partial weight panels), untied head."""
    from transformers import LlamaConfig

    out = tmp_path_factory.mktemp("odd-llama")
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=48,
        intermediate_size=44,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=24,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
    )
    return save_random_model(cfg, tok, out, seed=2)


MAX_LEN = 96


def runners(path: str, rows: int = 12, block_size: int = 16) -> tuple[LeanModelRunner, LeanModelRunner]:
    """A torch-step and a native-step runner over the same weights, each with blocks for ``rows`` rows of ``MAX_LEN``."""
    cfg = AutoConfig.from_pretrained(path)
    budget = KVBudget(block_size=block_size, num_blocks=rows * -(-MAX_LEN // block_size))
    make = lambda native: LeanModelRunner(path, cfg, budget, MAX_LEN, torch.float32, torch.device("cpu"), native)  # noqa: E731
    torch_runner, native_runner = make(False), make(True)
    assert torch_runner.native is None and native_runner.native is not None
    return torch_runner, native_runner


def fill(runner: LeanModelRunner, prompts: dict[int, list[int]]) -> dict[int, list[int]]:
    """Prefill each row's prompt into its own blocks (``row_tables``); returns the tables by row."""
    tables = dict(zip(prompts, row_tables(runner, list(prompts), MAX_LEN)))
    for row, ids in prompts.items():
        runner.prefill([PrefillItem(tables[row], ids, 0)])
    return tables


def kv_at(runner: LeanModelRunner, cache: str, table: list[int], position: int) -> torch.Tensor:
    """Every layer's K (``k_all``) or V of one position: [layers, kv_heads, d]."""
    bs = runner.cache.block_size
    return getattr(runner.cache, cache)[:, table[position // bs], :, position % bs]


@pytest.mark.parametrize(
    "model, block_size", [("tiny_model_path", 16), ("tiny_qwen2_path", 32), ("odd_llama_path", 16)]
)
@pytest.mark.usefixtures("tiny_model_path")  # getfixturevalue picks each case's model
def test_native_step_gives_the_torch_steps_logits_and_kv_in_any_block_order(model, block_size, request):
    """Qwen3 (q/k norms, head_dim 16), Qwen2 (qkv bias, untied head), the odd Llama (biases, head_dim 24, partial
    panels): rows whose blocks are scattered over the pool, out of order (tables of different widths, a row
    crossing a block boundary); logits and the K/V written at each row's position."""
    path = request.getfixturevalue(model)
    a, b = runners(path, block_size=block_size)
    rng = random.Random(0)
    prompts = {s: [rng.randrange(3, 400) for _ in range(rng.randint(5, 70))] for s in (9, 0, 4, 7, 2)}
    prompts[5] = [rng.randrange(3, 400) for _ in range(block_size - 1)]  # its next tokens open a new block
    rows = list(prompts)
    for r in (a, b):  # blocks in descending order: no row's blocks are contiguous
        tables = [list(reversed(t)) for t in row_tables(r, rows, MAX_LEN)]
        for t, s in zip(tables, rows):
            r.prefill([PrefillItem(t, prompts[s], 0)])
    positions = [len(prompts[s]) for s in rows]
    tokens = [rng.randrange(3, 400) for _ in rows]
    for _ in range(3):  # a few steps: each reads the K/V the previous one wrote
        now = [t[: p // block_size + 1] for t, p in zip(tables, positions)]  # each row's table as the scheduler has it
        want, got = a.decode(now, tokens, positions), b.decode(now, tokens, positions)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got - want).abs().max()
        for t, p in zip(tables, positions):
            for cache in ("k_all", "v_all"):
                assert torch.allclose(kv_at(b, cache, t, p), kv_at(a, cache, t, p), atol=1e-5)
        tokens = want.argmax(-1).tolist()
        positions = [p + 1 for p in positions]


def test_native_shared_prefix_segments_read_the_prefix_once_with_the_same_result(tiny_model_path):
    """Rows sharing one prompt's blocks (the full ones shared, the partial last one copied, as the scheduler does;
    a group larger than a segment, in scattered rows, plus a second group and rows of their own): with the
    groups declared, the native step reads each prefix once per segment; the logits equal the same step
    without groups and the torch step's."""
    from training.deployment.engine.runners.native import SEGMENT_ROWS, segments

    a, b = runners(tiny_model_path, rows=16)
    rng = random.Random(1)
    shared, other = [rng.randrange(3, 400) for _ in range(60)], [rng.randrange(3, 400) for _ in range(33)]
    group1 = [0, 2, 3, 5, 6, 8, 9, 11, 12, 14]  # 10 rows > SEGMENT_ROWS: split into two segments
    group2 = [1, 13]
    prompts = {}
    for s in group1:
        prompts[s] = shared + [rng.randrange(3, 400) for _ in range(rng.randint(0, 9))]
    for s in group2:
        prompts[s] = other + [rng.randrange(3, 400) for _ in range(rng.randint(1, 5))]
    for s in (4, 7, 10, 15):
        prompts[s] = [rng.randrange(3, 400) for _ in range(rng.randint(3, 50))]
    slots = sorted(prompts)
    for r in (a, b):
        own = dict(zip(slots, row_tables(r, slots, MAX_LEN)))
        bs = r.cache.block_size
        r.prefill([PrefillItem(own[group1[0]], shared, 0), PrefillItem(own[group2[0]], other, 0)])  # computed once
        tables = dict(own)
        for group, prefix in ((group1, shared), (group2, other)):
            full, part = divmod(len(prefix), bs)
            for s in group[1:]:  # the leader's full blocks shared, its partial block copied
                tables[s] = own[group[0]][:full] + own[s][full:]
                r.copy_block(own[group[0]][full], own[s][full], part)
        for s, ids in prompts.items():  # each row's own tokens after the prefix
            start = len(shared) if s in group1 else len(other) if s in group2 else 0
            if len(ids) > start:
                r.prefill([PrefillItem(tables[s], ids[start:], start)])
    positions = [len(prompts[s]) for s in slots]
    tokens = [rng.randrange(3, 400) for _ in slots]
    rows = [tables[s] for s in slots]
    row = {s: i for i, s in enumerate(slots)}
    groups = [SharedPrefix([row[s] for s in group1], len(shared)), SharedPrefix([row[s] for s in group2], len(other))]
    starts, seg_rows, prefixes = segments(positions, groups)
    sizes = sorted(e - s for s, e, p in zip(starts, starts[1:], prefixes) if p > 0)
    assert sizes == [2, len(group1) - SEGMENT_ROWS, SEGMENT_ROWS] and sorted(seg_rows) == list(range(len(slots)))
    plain = b.decode(rows, tokens, positions).clone()
    grouped = b.decode(rows, tokens, positions, groups).clone()
    want = a.decode(rows, tokens, positions)
    assert torch.allclose(grouped, plain, atol=1e-5) and torch.allclose(grouped, want, atol=1e-4)


@pytest.mark.parametrize("model", ["tiny_model_path", "odd_llama_path"])
@pytest.mark.usefixtures("tiny_model_path")  # getfixturevalue picks each case's model
def test_a_prefill_of_many_rows_on_torchs_gemm_gives_the_torch_runners_logits_and_kv(model, request, monkeypatch):
    """Five prompts prefilled in one call (over ``GEMM_MIN_ROWS`` rows, lowered to 256 here: the native runner's
    matmuls run torch's GEMM on its panels): the torch runner's last-position logits and K/V; and those of the same
    prompts prefilled one at a time (under ``GEMM_MIN_ROWS`` rows each: the panel kernel)."""
    from training.deployment.engine.runners import native

    monkeypatch.setattr(native, "GEMM_MIN_ROWS", 256)
    a, b = runners(request.getfixturevalue(model))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(60, MAX_LEN))] for _ in range(5)]
    assert sum(map(len, prompts)) >= native.GEMM_MIN_ROWS > max(map(len, prompts))
    tables = row_tables(a, list(range(5)), MAX_LEN)
    items = [PrefillItem(t, ids, 0) for t, ids in zip(tables, prompts)]
    want, got = a.prefill(items).clone(), b.prefill(items).clone()
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got - want).abs().max()
    for t, ids in zip(tables, prompts):
        for cache in ("k_all", "v_all"):
            assert torch.allclose(kv_at(b, cache, t, len(ids) - 1), kv_at(a, cache, t, len(ids) - 1), atol=1e-5)
    one_at_a_time = torch.cat([b.prefill([it]) for it in items])
    assert torch.allclose(one_at_a_time, got, atol=1e-5), (one_at_a_time - got).abs().max()


@pytest.mark.parametrize("m", [1, 5, 12, 13, 40, 97, 200, GEMM_MIN_ROWS - 1, GEMM_MIN_ROWS, GEMM_MIN_ROWS + 45])
def test_native_matmul_matches_torch_with_bias_and_in_place_residual(m):
    """Below ``GEMM_MIN_ROWS`` rows the panel kernel; from it torch's GEMM on the panels laid out a slice at a time
    (1100 columns: two whole slices of 512 and a partial one, its last panel partial)."""
    from training.deployment.engine.runners.native import GEMM_SLICE_COLUMNS, linear, pack_weight

    assert 1100 > 2 * GEMM_SLICE_COLUMNS
    g = torch.Generator().manual_seed(m)
    for n, k in [(1, 7), (31, 64), (32, 5), (33, 64), (100, 130), (1100, 40)]:
        a, w, bias = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        packed = pack_weight(w)
        assert torch.allclose(linear(a, packed, n), a @ w.T, atol=1e-4)
        res = torch.randn(m, n, generator=g)
        want = a @ w.T + bias + res
        got = linear(a, packed, n, bias, residual=res)
        assert got.data_ptr() == res.data_ptr() and torch.allclose(got, want, atol=1e-4)


def test_engine_on_the_native_step_samples_what_the_torch_step_samples(tiny_model_path):
    """Seeded sampling and greedy, under churn (more requests than slots, prefix reuse): the same tokens,
    logprobs within 1e-5."""
    from tests.deployment.engine.test_engine_prefix_cache import sampled

    rng = random.Random(5)
    base = [rng.randrange(3, 400) for _ in range(20)]
    requests = [
        (base + [rng.randrange(3, 400) for _ in range(rng.randint(0, 30))], sampled(seed=i, max_tokens=24))
        for i in range(10)
    ]
    requests += [(base, greedy(20)) for _ in range(3)]

    async def body(eng):
        return await asyncio.gather(*[eng.generate(p, sp) for p, sp in requests])

    native = run_engine(tiny_model_path, body, max_batch_size=6, decode_kernel="native")
    ref = run_engine(tiny_model_path, body, max_batch_size=6, decode_kernel="torch")
    for x, y in zip(native, ref):
        assert x.output_token_ids == y.output_token_ids
        assert x.output_logprobs == pytest.approx(y.output_logprobs, abs=1e-5)


def test_native_step_never_reads_what_a_reused_block_held_before(tiny_model_path):
    """Its runner hands reused blocks out unzeroed (``zero_handed_out``): with every block of the pool NaN
    between two identical rounds of requests, the second round samples exactly what the first did."""
    from tests.deployment.engine.test_engine_prefix_cache import sampled

    rng = random.Random(7)
    requests = [
        ([rng.randrange(3, 400) for _ in range(rng.randint(5, 40))], sampled(seed=i, max_tokens=20)) for i in range(8)
    ]

    async def body(eng):
        first = await asyncio.gather(*[eng.generate(p, sp) for p, sp in requests])
        cache = eng.engine.runner.cache
        assert not cache.zero_handed_out and eng.engine.scheduler.blocks.used == 0  # idle: nothing held
        cache.k_all[:, : cache.num_blocks].fill_(float("nan"))
        cache.v_all[:, : cache.num_blocks].fill_(float("nan"))
        second = await asyncio.gather(*[eng.generate(p, sp) for p, sp in requests])
        return first, second

    first, second = run_engine(
        tiny_model_path, body, max_batch_size=4, decode_kernel="native", enable_prefix_caching=False
    )
    for x, y in zip(first, second):
        assert x.output_token_ids == y.output_token_ids and x.output_logprobs == y.output_logprobs


def test_native_step_never_reads_a_handed_out_position_before_writing_it(tiny_model_path):
    """Every block NaN-filled as it is handed out, prefix caching on: groups of identical prompts (followers, shared
    full blocks, partial blocks copied from a running or a cached sequence), a group member arriving late, a second
    round hitting the cache. Any read of a position before its K/V is written would turn a row's logits NaN; every
    request samples what an engine that zeroes its blocks samples."""
    from tests.deployment.engine.test_engine_prefix_cache import sampled

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (21, 37, 50)]  # none a whole number of blocks

    async def traffic(eng):
        def group(round_: int):
            return [
                eng.generate(p, sampled(seed=100 * round_ + 10 * g + i, max_tokens=18))
                for g, p in enumerate(prompts)
                for i in range(4)
            ]

        first = asyncio.gather(*group(0))
        await asyncio.sleep(0.05)  # a late member: reuses the running group's blocks
        late = await eng.generate(prompts[0], sampled(seed=999, max_tokens=18))
        return [*(await first), late, *(await asyncio.gather(*group(1)))]

    async def poisoned(eng):
        cache = eng.engine.runner.cache
        assert not cache.zero_handed_out

        def hand_out(block: int) -> None:
            cache.hand_out(block)  # unzeroed: only counted touched
            cache.k_all[:, block].fill_(float("nan"))
            cache.v_all[:, block].fill_(float("nan"))

        eng.engine.scheduler.blocks.hand_out = hand_out
        return await traffic(eng)

    async def zeroed(eng):
        eng.engine.runner.cache.zero_handed_out = True
        return await traffic(eng)

    got = run_engine(tiny_model_path, poisoned, max_batch_size=8, decode_kernel="native")
    want = run_engine(tiny_model_path, zeroed, max_batch_size=8, decode_kernel="native")
    for x, y in zip(got, want):
        assert x.output_token_ids == y.output_token_ids
        assert x.output_logprobs == pytest.approx(y.output_logprobs, abs=1e-5)


def test_native_library_is_built_once_per_source_and_cpu_and_reused(tmp_path, monkeypatch):
    import training.deployment.engine.runners.native as native

    monkeypatch.setenv("TRAINING_CACHE", str(tmp_path))
    native.load_library.cache_clear()
    try:
        native.load_library()
        [built] = list((tmp_path / "native").glob("native_decode-*.so"))
        stamp = built.stat().st_mtime_ns
        native.load_library.cache_clear()
        native.load_library()
        assert [p.name for p in (tmp_path / "native").iterdir()] == [built.name]  # no temp file left behind
        assert built.stat().st_mtime_ns == stamp  # loaded, not compiled again
    finally:
        native.load_library.cache_clear()


def test_without_a_working_compiler_auto_falls_back_and_native_names_why(tmp_path, monkeypatch, tiny_model_path):
    """``CC=false`` (a compiler that fails, for real): ``auto`` keeps the torch step and says why (the path
    build_runner chose), ``native`` refuses with the reason."""
    from training.deployment.engine.runners.build import build_runner
    from training.utils.config import EngineConfig

    import training.deployment.engine.runners.native as native

    monkeypatch.setenv("TRAINING_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    native.load_library.cache_clear()
    try:
        reason = native.native_available(torch.device("cpu"), torch.float32)
        assert reason is not None and "compiling native_decode.c failed" in reason
        cfg = AutoConfig.from_pretrained(tiny_model_path)
        make = lambda kernel: build_runner(  # noqa: E731
            EngineConfig(model=tiny_model_path, max_batch_size=2, max_model_len=32, decode_kernel=kernel),
            cfg,
            tiny_model_path,
            torch.device("cpu"),
            torch.float32,
        )
        runner, path = make("auto")
        assert runner.native is None and path.name == "torch" and "compiling native_decode.c failed" in path.reason
        with pytest.raises(ValueError, match="decode_kernel='native' cannot run here: compiling"):
            make("native")
        monkeypatch.setenv("CC", "no-such-compiler-here")
        native.load_library.cache_clear()
        assert "no C compiler" in native.native_available(torch.device("cpu"), torch.float32)
        assert "runs float32 and bfloat16" in native.native_available(torch.device("cpu"), torch.float16)
    finally:
        native.load_library.cache_clear()


def test_native_step_runs_on_torchs_openmp_pool():
    """The library binds to the libgomp torch loaded (one OpenMP runtime, one pool, torch's thread count)."""
    from training.deployment.engine.runners.native import load_library

    load_library()
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    assert len(gomp) == 1, gomp


def test_native_sampler_draws_what_the_torch_sampler_draws_and_fails_only_broken_rows():
    """Plain rows (temperature alone) at several temperatures, the same per-request seeds on both paths: the same
    tokens and logprobs within 1e-5; a NaN row and a +inf row fail alone."""
    from training.deployment.engine.requests import SamplingParams
    from training.deployment.engine.token_sampler import sample
    from training.deployment.engine.sequence import Sequence

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(96, 1000, generator=g) * torch.linspace(0.1, 8, 96)[:, None]
    logits[5, 17] = 60.0  # one dominant token
    logits[6] = -1e30  # every token equally (un)likely after the shift
    temps = [0.3, 0.7, 1.0, 1.0, 1.7, 1e-4][:6] * 16

    def seqs():
        return [
            Sequence([1], SamplingParams(temperature=t), torch.Generator().manual_seed(100 + i), frozenset())
            for i, t in enumerate(temps)
        ]

    native, ref = sample(logits, seqs(), native=True), sample(logits, seqs(), native=False)
    assert native.token_ids == ref.token_ids
    assert native.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert native.failed == [None] * len(temps)
    broken = logits.clone()
    broken[3, 9], broken[40, 2] = float("nan"), float("inf")
    out = sample(broken, seqs(), native=True)
    assert [i for i, f in enumerate(out.failed) if f] == [3, 40]
    assert [t for i, t in enumerate(out.token_ids) if i not in (3, 40)] == [
        t for i, t in enumerate(ref.token_ids) if i not in (3, 40)
    ]


def test_the_profile_build_times_every_phase_of_a_step(tiny_model_path):
    """``NativeDecoder(profile=True)`` (benchmarks/profile_decode.py): seconds per phase, reset on read."""
    from training.deployment.engine.runners.native import PHASES, NativeDecoder

    torch_runner, runner = runners(tiny_model_path)
    with pytest.raises(ValueError, match="holds no memory"):  # the native runner's matmul weights are its panels
        NativeDecoder(runner, profile=True)
    timed = NativeDecoder(torch_runner, profile=True)  # as benchmarks/profile_decode.py builds it
    tables = list(fill(runner, {0: [5, 6, 7], 1: [8, 9]}).values())
    assert tables == list(fill(torch_runner, {0: [5, 6, 7], 1: [8, 9]}).values())
    want = runner.native.decode(tables, [3, 4], [3, 2]).clone()
    got = timed.decode(tables, [3, 4], [3, 2])
    assert torch.allclose(got, want, atol=1e-6)  # the same step, timed
    phases = timed.phase_seconds()
    assert list(phases) == list(PHASES) and all(v >= 0 for v in phases.values())
    assert phases["layer matmuls"] > 0 and phases["attention"] > 0
    assert sum(timed.phase_seconds().values()) == 0  # read and reset
    with pytest.raises(RuntimeError, match="profile=True"):
        runner.native.phase_seconds()


def test_a_weight_update_is_repacked_in_place_and_decoded_with(tiny_qwen2_path):  # noqa: F811 (the fixture)
    """``load_weights`` (every weight update ends there or in ``weights_changed``) repacks into the same buffers:
    the next native step decodes with the new weights (biases too), and no second copy of the weights is made."""
    from training.deployment.engine.weights import load_safetensors

    a, b = runners(tiny_qwen2_path)
    before = {name: [t.data_ptr() for t in bufs] for name, bufs in b.native.packed.items()}
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in load_safetensors(tiny_qwen2_path).items()}
    for r in (a, b):
        r.load_weights(new)
        tables = list(fill(r, {3: [11, 12, 13, 14], 5: [20, 21]}).values())
    want, got = a.decode(tables, [7, 8], [4, 2]), b.decode(tables, [7, 8], [4, 2])
    assert torch.allclose(got, want, atol=1e-4)
    assert {name: [t.data_ptr() for t in bufs] for name, bufs in b.native.packed.items()} == before


def _step_logits(runner: LeanModelRunner, prompts: dict[int, list[int]]) -> torch.Tensor:
    """A prefill of every prompt (into fresh blocks) and one decode step: both kinds of forward, their logits."""
    tables = row_tables(runner, list(prompts), MAX_LEN)
    first = runner.prefill([PrefillItem(t, ids, 0) for t, ids in zip(tables, prompts.values())]).clone()
    step = runner.decode(tables, [7] * len(prompts), [len(ids) for ids in prompts.values()])
    return torch.cat([first, step.clone()])


@pytest.mark.parametrize("model", ["tiny_qwen2_path", "odd_llama_path"])
@pytest.mark.usefixtures("tiny_model_path")  # getfixturevalue picks each case's model
def test_native_runner_holds_the_matmul_weights_once_and_updates_them_exactly(model, request):
    """With the native step the packed panels are the only copy of the matmul weights between updates: the
    checkpoint-layout tensors hold no memory and no oneDNN copy exists. A full update, a streamed one and a
    streamed one that stops before writing all serve what they should: the new weights (what a full update
    with them serves), or bit for bit the old ones (the panels unpacked and packed again)."""
    from training.deployment.engine.weights import load_safetensors

    path = request.getfixturevalue(model)
    _, runner = runners(path)
    weights = [L[name + "_w"] for L in runner.layers for name in ("qkv", "o", "gate_up", "down")]
    assert all(w.untyped_storage().nbytes() == 0 for w in weights)
    assert runner.lm_head_packed is None and not any(k.endswith("_packed") for L in runner.layers for k in L)
    rng = random.Random(1)
    prompts = {row: [rng.randrange(3, 400) for _ in range(rng.randint(5, 40))] for row in range(3)}
    before = _step_logits(runner, prompts)

    runner.begin_weight_write()  # a streamed update that fails before its first tensor
    runner.weights_changed()
    assert torch.equal(_step_logits(runner, prompts), before)
    assert all(w.untyped_storage().nbytes() == 0 for w in weights)

    scaled = {name: t * 1.5 if t.ndim == 2 else t for name, t in load_safetensors(path).items()}
    runner.begin_weight_write()  # a streamed update: every tensor written one by one
    for name, target in runner.targets.items():
        target.copy_(scaled[name])
    runner.weights_changed()
    streamed = _step_logits(runner, prompts)
    assert not torch.allclose(streamed, before, atol=1e-3)
    runner.load_weights(load_safetensors(path))  # a full update back to the checkpoint
    assert torch.equal(_step_logits(runner, prompts), before)
    runner.load_weights(scaled)  # one layer at a time: the checkpoint-layout weights are given back again
    assert torch.equal(_step_logits(runner, prompts), streamed)
    assert all(w.untyped_storage().nbytes() == 0 for w in weights)
