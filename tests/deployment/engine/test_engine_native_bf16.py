"""The native (C) decode step in bf16: against the bf16 torch step and an fp32 reference, its matmul, and a bf16
server choosing it.

Tolerance. bf16 keeps 8 significant bits (unit roundoff u = 2^-9 ≈ 2e-3; one rounding moves a value by up to
u relative). The bf16 torch step rounds after every op (weights, activations, the residual stream, K/V,
norms, scores); the C step rounds the weights, the K/V and (on AMX / ``vdpbf16ps``) the matmuls' inputs,
and keeps the rest in fp32. Both differ from fp32 by a few roundings of the logits' scale, so the bound is
``BF16_ATOL_SCALE`` roundings of the largest |logit| (observed: ~1 on these models); a wrong K/V read, a
missing bias or a wrong panel layout moves logits by O(|logit|) and fails it. The fp32 gap is reported and
asserted loosely: the C step is no further from fp32 than the torch step is.
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
import torch
from transformers import AutoConfig

from training.deployment.engine.kv_cache import KVBudget
from training.deployment.engine.runners.lean import LeanModelRunner, PrefillItem, SharedPrefix
from training.deployment.engine.runners.native import BF16_MATMUL, BF16_MATMULS
from tests.deployment.engine.test_engine import greedy, row_tables, run_engine, tiny_qwen2_path  # noqa: F401 (a fixture)
from tests.deployment.engine.test_engine_native import odd_llama_path  # noqa: F401 (a fixture)

MAX_LEN = 96
BF16_U = 2.0**-9
"""bf16's unit roundoff."""
BF16_ATOL_SCALE = 8
"""Roundings of the largest |logit| that two bf16 steps (or one and fp32) may differ by."""
FP32_TORCH_C = ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True))
"""(dtype, native) of the fp32 reference, the bf16 torch step and the bf16 C step."""


@pytest.fixture(autouse=True)
def native_bf16():
    from training.deployment.engine.runners.native import native_available

    reason = native_available(torch.device("cpu"), torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)


def runner(path: str, dtype: torch.dtype, native: bool, matmuls: str = BF16_MATMUL, block_size: int = 16):
    """A runner with blocks for 12 rows of ``MAX_LEN``; ``native``: the C step (with the bf16 matmul kernel ``matmuls``)."""
    from training.deployment.engine.runners.native import NativeDecoder

    cfg = AutoConfig.from_pretrained(path)
    budget = KVBudget(block_size=block_size, num_blocks=12 * -(-MAX_LEN // block_size))
    r = LeanModelRunner(path, cfg, budget, MAX_LEN, dtype, torch.device("cpu"), native=False)
    if native:
        r.native = NativeDecoder(r, matmuls=matmuls)
    return r


def decode_run(r: LeanModelRunner, steps: int = 3, seed: int = 0) -> tuple[torch.Tensor, list, list[int]]:
    """Rows in scattered blocks (six with a shared 40-token prompt, declared as a group, four of their own), prefilled,
    then ``steps`` decode steps fed fixed tokens; (logits [steps, rows, V], tables, last positions)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 400) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 400) for _ in range(rng.randint(0, 9))] for _ in range(6)]
    prompts += [[rng.randrange(3, 400) for _ in range(rng.randint(3, 60))] for _ in range(4)]
    tables = [list(reversed(t)) for t in row_tables(r, list(range(len(prompts))), MAX_LEN)]
    for t, p in zip(tables, prompts):
        r.prefill([PrefillItem(t, p, 0)])
    positions = [len(p) for p in prompts]
    bs = r.cache.block_size
    groups = [SharedPrefix(list(range(6)), len(shared) // bs * bs)]
    out = []
    for i in range(steps):
        tokens = [rng.randrange(3, 400) for _ in prompts]
        out.append(r.decode(tables, tokens, positions, groups if i % 2 else ()).float().clone())
        positions = [p + 1 for p in positions]
    return torch.stack(out), tables, positions


@pytest.mark.parametrize("matmuls", BF16_MATMULS)
@pytest.mark.parametrize(
    "model, block_size", [("tiny_model_path", 16), ("tiny_qwen2_path", 32), ("odd_llama_path", 16)]
)
@pytest.mark.usefixtures("tiny_model_path")  # getfixturevalue picks each case's model
def test_bf16_native_step_matches_the_bf16_torch_step_and_is_no_further_from_fp32(model, block_size, matmuls, request):
    """Qwen3, Qwen2 (biases, untied head), the odd Llama (head_dim 24: scalar attention; partial panels, odd widths);
    every bf16 matmul kernel (``BF16_MATMULS``; those the CPU lacks build as the widening one): logits within bf16 tolerance of the bf16 torch step, K/V written within a few roundings of it, and no
    further from fp32 than the torch step."""
    path = request.getfixturevalue(model)
    ref, _, _ = decode_run(runner(path, torch.float32, native=False, block_size=block_size))
    tb = runner(path, torch.bfloat16, native=False, block_size=block_size)
    cb = runner(path, torch.bfloat16, native=True, matmuls=matmuls, block_size=block_size)
    want, tables, positions = decode_run(tb)
    got, _, _ = decode_run(cb)
    scale = ref.abs().max().item()
    atol = BF16_ATOL_SCALE * BF16_U * scale
    gap_c, gap_torch = (got - ref).abs().max().item(), (want - ref).abs().max().item()
    print(f"{model}: max |logit| {scale:.3f}; vs fp32: C {gap_c:.2e}, torch {gap_torch:.2e}; bound {atol:.2e}")
    assert (got - want).abs().max().item() <= atol, (got - want).abs().max()
    assert gap_c <= gap_torch and gap_c <= atol, (gap_c, gap_torch)
    bs = cb.cache.block_size
    for t, p in zip(tables, positions):  # the K/V of the last step's token, as each step wrote it
        for cache in ("k_all", "v_all"):
            a = getattr(cb.cache, cache)[:, t[(p - 1) // bs], :, (p - 1) % bs].float()
            b = getattr(tb.cache, cache)[:, t[(p - 1) // bs], :, (p - 1) % bs].float()
            assert torch.allclose(a, b, rtol=4 * BF16_U, atol=4 * BF16_U * b.abs().max().item()), (a - b).abs().max()


@pytest.mark.parametrize("matmuls", BF16_MATMULS)
@pytest.mark.parametrize("m", [1, 5, 13, 40])
def test_bf16_matmul_is_the_fp32_product_of_its_bf16_inputs(m, matmuls):
    """Odd and even K (pairs along K, padded), widths that are not whole panels, bias and in-place residual: the
    product of the bf16 weights with ``a`` (rounded to bf16 first by the ``vdpbf16ps`` and AMX kernels) in fp32 sums.
    Whether the library built here rounds ``a`` is the library's own answer (``auto`` on a CPU with AVX-512 BF16 but
    no AMX widens; with AMX it rounds), checked against the features gcc sees."""
    from training.deployment.engine.runners.native import linear, load_library, pack_weight

    lib = load_library(dtype=torch.bfloat16, matmuls=matmuls)
    rounds_a = bool(lib.matmul_rounds_activations())
    macros = _predefined_macros()
    expected_rounding = {
        "widen": False,
        "vdpbf16ps": "__AVX512BF16__" in macros,
        "auto": "__AMX_BF16__" in macros and "__AMX_TILE__" in macros and "__AVX512BF16__" in macros,
    }[matmuls]
    assert rounds_a == expected_rounding, (matmuls, rounds_a)
    g = torch.Generator().manual_seed(m)
    for n, k in [(1, 7), (31, 64), (33, 5), (100, 130), (64, 96)]:
        a, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).bfloat16()
        bias, res = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
        packed = pack_weight(w, matmuls=matmuls)
        assert packed.dtype == torch.bfloat16 and packed.numel() == load_library(
            dtype=torch.bfloat16, matmuls=matmuls
        ).packed_size(n, k)
        want = (a.bfloat16().float() if rounds_a else a) @ w.float().T + bias + res
        got = linear(a, packed, n, bias, residual=res, matmuls=matmuls)
        assert got.data_ptr() == res.data_ptr() and torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def _predefined_macros() -> str:
    """What ``gcc -march=native`` predefines here (``__AVX512BF16__`` where the CPU has AVX-512 BF16), with the
    flags ``TRAINING_CPU_ISA`` adds (``no_amx`` / ``avx2``: the paths of the CPUs without them)."""
    import os
    import subprocess

    from training.deployment.engine.runners.native import CPU_ISAS, cpu_isa

    cc = os.environ.get("CC") or "gcc"
    return subprocess.run(
        [cc, "-march=native", *CPU_ISAS[cpu_isa()], "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True
    ).stdout


def test_bf16_weight_update_is_repacked_and_its_norms_recopied(tiny_qwen2_path):  # noqa: F811 (the fixture)
    """A bf16 runner's weight update (weights, biases and norms) reaches the C step: its packed panels and its fp32
    copies of the norms are rewritten in place, and it decodes like the bf16 torch step on the new weights."""
    from training.deployment.engine.weights import load_safetensors

    f32, tb, cb = (runner(tiny_qwen2_path, dtype, native) for dtype, native in FP32_TORCH_C)
    before = [t.data_ptr() for t in cb.native.norms["in_norm"]]
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in load_safetensors(tiny_qwen2_path).items()}
    for r in (f32, tb, cb):
        r.load_weights(new)
    assert torch.equal(cb.native.norms["in_norm"][1], cb.layers[1]["in_norm"].float())
    assert [t.data_ptr() for t in cb.native.norms["in_norm"]] == before
    ref, want, got = (decode_run(r, steps=2)[0] for r in (f32, tb, cb))
    assert (got - want).abs().max().item() <= BF16_ATOL_SCALE * BF16_U * ref.abs().max().item()
    assert (got - ref).abs().max() <= (want - ref).abs().max()


def test_bf16_engine_on_the_native_step_decodes_the_torch_steps_greedy_tokens(tiny_model_path):
    """A bf16 engine under churn (more requests than rows, a shared prompt reused from the prefix cache): the C step's
    greedy tokens equal the bf16 torch step's, their logprobs within bf16 tolerance."""
    rng = random.Random(11)
    base = [rng.randrange(3, 400) for _ in range(24)]
    prompts = [base + [rng.randrange(3, 400) for _ in range(rng.randint(0, 20))] for _ in range(8)] + [base] * 3

    async def body(eng):
        res = await asyncio.gather(*[eng.generate(p, greedy(12)) for p in prompts])
        return res, eng.stats()

    (native, stats), (ref, _) = (
        run_engine(tiny_model_path, body, max_batch_size=5, dtype="bfloat16", decode_kernel=kernel)
        for kernel in ("native", "torch")
    )
    assert stats["execution_path"] == "native" and stats["cached_prompt_tokens"] > 0
    for x, y in zip(native, ref):
        assert x.output_token_ids == y.output_token_ids
        assert x.output_logprobs == pytest.approx(y.output_logprobs, abs=BF16_ATOL_SCALE * BF16_U * 4)


def test_a_bf16_server_reports_the_native_step_over_http(embedded_server):
    """``dtype=bfloat16`` with the default ``decode_kernel="auto"``: ``GET /stats`` says the native step, bfloat16, and a
    completion decodes on it."""
    headers = {"Authorization": "Bearer k"}

    async def go(dep):
        async with aiohttp.ClientSession(headers=headers) as s:
            body = {"model": "tiny", "prompt": [5, 17, 42, 99], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
            async with s.post(dep.base_url + "/v1/completions", data=json.dumps(body)) as r:
                done = (r.status, await r.json(content_type=None))
            async with s.get(dep.base_url + "/stats") as r:
                return done, await r.json(content_type=None)

    dep = embedded_server(api_key="k", served_model_name="tiny", max_model_len=128, max_batch_size=4, dtype="bfloat16")
    (status, out), stats = asyncio.run(go(dep))
    assert status == 200 and out["usage"]["completion_tokens"] == 6, out
    assert stats["execution_path"] == "native", stats["execution_path_reason"]
    assert "bfloat16" in stats["execution_path_reason"]


def test_bf16_native_step_decodes_the_same_after_sleep_and_wake(tiny_model_path):
    """Sleep level 1 (packed panels freed) and level 2 (weights freed, reloaded): after wake the C step reads the new
    storage (the struct rebuilt, the panels and the fp32 norm copies refreshed) and gives the same logits, bitwise."""
    from training.deployment.engine.runners.sleep import RunnerSleep
    from training.deployment.engine.weights import load_safetensors

    r = runner(tiny_model_path, torch.bfloat16, True)
    before = decode_run(r)[0]
    sleep = RunnerSleep(r)
    for level in (1, 2):
        sleep.sleep(level)
        if level == 2:
            sleep.restore_weights()
            r.load_weights(load_safetensors(tiny_model_path))
        sleep.wake()
        assert torch.equal(decode_run(r)[0], before), level


def test_an_unknown_cpu_isa_is_refused_naming_it(monkeypatch):
    from training.deployment.engine.runners.native import load_library

    monkeypatch.setenv("TRAINING_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="TRAINING_CPU_ISA='avx9'"):
        load_library(dtype=torch.bfloat16)
