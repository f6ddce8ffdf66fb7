"""Sampling semantics: every field does what the README says, against exact formulas and transformers.

Unit tests call ``sample()`` on synthetic logits (the real function, thousands of rows in one
batch); engine tests run the tiny model and compare greedy outputs with ``transformers``'
``generate`` using its own logits processors (repetition penalty, sequence bias, min new tokens).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from training.deployment.engine import AsyncEngine, EngineConfig, EngineError, SamplingParams
from training.deployment.engine.inbox import AddRequest
from training.deployment.engine.requests import SequenceFailedError
from training.deployment.engine.token_sampler import _process, sample
from training.deployment.engine.sequence import Sequence

PROMPT = [300, 301, 302, 303, 7, 8, 9, 10, 11, 12, 13]


def rows(logits_V: torch.Tensor, params: SamplingParams, n: int, prompt=(1, 2), output=(), stop_ids=frozenset()):
    """``n`` sequences with the same params, each with its own generator (seed i), and their logits."""
    seqs = []
    for i in range(n):
        seq = Sequence(list(prompt), params, torch.Generator().manual_seed(i), frozenset(stop_ids))
        for t in output:
            seq.append(t, 0.0, 0)
        seqs.append(seq)
    return logits_V.expand(n, -1).clone(), seqs


def expected_distribution(logits_V: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The README's rule, written independently: softmax(z / T), keep top-k, min-p, then top-p of the rest."""
    q = torch.softmax(logits_V.double() / p.temperature, -1)
    order = q.argsort(descending=True).tolist()
    kept = order[: p.top_k] if p.top_k else order
    kept = [t for t in kept if q[t] >= p.min_p * q[order[0]]]
    mass, total, nucleus = 0.0, sum(q[t] for t in kept), []
    for t in kept:
        if mass >= p.top_p * total and nucleus:
            break
        nucleus.append(t)
        mass += q[t]
    out = torch.zeros_like(q)
    out[nucleus] = q[nucleus] / q[nucleus].sum()
    return out


LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize(
    "fields",
    [
        dict(),
        dict(top_k=3),
        dict(top_p=0.7),
        dict(min_p=0.3),
        dict(temperature=0.5),
        dict(top_k=4, top_p=0.8, min_p=0.1, temperature=1.3),
    ],
)
def test_draws_follow_the_renormalised_kept_distribution(fields):
    params = SamplingParams(**{"temperature": 1.0, **fields})
    logits, seqs = rows(LOGITS, params, 6000)
    out = sample(logits, seqs)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=len(LOGITS)).double() / len(seqs)
    want = expected_distribution(LOGITS, params)
    assert torch.all(counts[want == 0] == 0), (counts, want)  # a dropped token is never drawn
    assert (counts - want).abs().max() < 0.03, (counts, want)  # ~4 sigma at 6000 draws
    # the reported logprob is the model's at T, whatever was truncated
    ref = torch.log_softmax(LOGITS / params.temperature, -1)
    assert torch.allclose(torch.tensor(out.logprobs), ref[out.token_ids], atol=1e-6)
    assert out.failed == [None] * len(seqs)


def test_sorting_only_the_likeliest_candidates_draws_what_a_full_sort_draws(monkeypatch):
    """Rows whose kept prefix fits in the CANDIDATES sorted by topk, and rows that spill past them
    (flat distributions), draw exactly the tokens a whole-vocabulary sort gives, in any mix."""
    from training.deployment.engine import token_sampler as sampling

    V, n = 3000, 64
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(n, V, generator=g) * 4
    flat = torch.randn(n, V, generator=g) * 0.1
    logits = torch.cat([peaked, flat])
    fields = [
        dict(top_p=0.9),
        dict(top_p=0.5, min_p=0.01),
        dict(min_p=0.001),
        dict(top_k=1000, top_p=0.95),
        dict(top_k=20),
        dict(top_p=0.999),
    ]
    params = [SamplingParams(temperature=1.0, **fields[i % len(fields)]) for i in range(2 * n)]
    probs = torch.softmax(logits, -1)
    u = torch.rand(2 * n, generator=g)
    fast = sampling._sample_truncated(probs, u, params)
    spilled = sampling._kept_prefix(probs, params, sampling.CANDIDATES)[1][:, -1]
    assert spilled[:n].sum() < n // 2 < spilled[n:].sum()  # both paths ran
    monkeypatch.setattr(sampling, "CANDIDATES", V)
    assert torch.equal(fast, sampling._sample_truncated(probs, u, params))
    for i in range(0, 2 * n, 9):  # and a row alone draws what it drew in the mix
        assert sampling._sample_truncated(probs[i : i + 1], u[i : i + 1], params[i : i + 1]).item() == fast[i].item()


@pytest.mark.parametrize("vocab", [1000, 1024])  # a partial last block, and whole blocks only
def test_a_plain_row_draws_the_first_token_whose_cumulative_mass_exceeds_u(vocab):
    """The block-wise draw (no running sum over the whole vocabulary) picks the token a float64
    running sum picks, for draws landing in every block; zero-probability tokens, including whole
    masked blocks and the ends of blocks, are never drawn."""
    from training.deployment.engine import token_sampler as sampling

    n = 4000
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(n, vocab, generator=g) * 2
    logits[:, 256:512] = float("-inf")  # a whole masked block
    logits[:, 255] = float("-inf")  # the last token of a block
    logits[: n // 2, -5:] = float("-inf")  # the end of the vocabulary
    probs = torch.softmax(logits, -1)
    u = torch.rand(n, generator=g)
    got = sampling._draw_blocked(probs, u)
    cum = probs.double().cumsum(-1)
    target = u.double()[:, None] * cum[:, -1:]
    want = torch.searchsorted(cum, target, right=True).squeeze(1)
    # only a target within fp32 rounding of a token boundary may fall on the neighbouring token
    near = (cum - target).abs().min(dim=-1).values < 1e-6
    assert torch.equal(got[~near], want[~near])
    assert near.sum() < n // 200
    assert (probs.gather(1, got[:, None]) > 0).all()
    assert set((got // sampling.DRAW_BLOCK).tolist()) >= {0, 2, (vocab - 1) // sampling.DRAW_BLOCK}
    # the edges: u = 0 draws the first token with mass, u just below 1 the last
    edge = sampling._draw_blocked(probs[:2], torch.tensor([0.0, 1.0 - 2**-24]))
    assert edge[0] == 0 and edge[1] == int(torch.nonzero(probs[1]).max())


def test_top_k_1_at_temperature_1_is_greedy_with_the_t1_logprob():
    logits, seqs = rows(LOGITS, SamplingParams(temperature=1.0, top_k=1), 200)
    out = sample(logits, seqs)
    assert set(out.token_ids) == {0}
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(LOGITS, -1)[0].item(), abs=1e-6)


def test_penalties_bias_and_min_tokens_follow_the_formula():
    logits_V = torch.tensor([1.0, -1.0, 2.0, 0.5, -2.0, 3.0])
    params = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias={3: 1.5, 4: -0.5}, min_tokens=5
    )
    logits, [seq] = rows(logits_V, params, 1, prompt=[0, 1], output=[2, 2, 4], stop_ids={5})
    z = _process(logits, [seq])[0]
    want = logits_V.clone()
    want[5] = -math.inf  # a stop id before min_tokens
    want[3] += 1.5
    want[4] += -0.5  # bias before penalties (vLLM's order)
    for t in (0, 1, 2, 4):  # repetition: prompt {0, 1} and output {2, 4}
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    want[2] -= 0.25 * 2 + 0.5  # frequency (twice) + presence
    want[4] -= 0.25 * 1 + 0.5
    assert torch.equal(z, want), (z, want)
    # greedy takes the argmax of the processed logits; the reported logprob stays the model's
    out = sample(logits, [replace_params(seq, temperature=0.0)])
    assert out.token_ids == [int(want.argmax())]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits_V, -1)[int(want.argmax())].item(), abs=1e-6)


def replace_params(seq: Sequence, **kw) -> Sequence:
    seq.params = replace(seq.params, **kw)
    return seq


def test_top_logprobs_are_the_k_best_of_the_reported_distribution():
    params = SamplingParams(temperature=0.8, top_logprobs=3, top_k=2, logit_bias={7: 50.0})
    logits, seqs = rows(LOGITS, params, 4)
    out = sample(logits, seqs)
    ref = torch.log_softmax(LOGITS / 0.8, -1)
    best = ref.topk(3)
    assert out.token_ids == [7] * 4  # the bias decides the draw ...
    for alts, lp in zip(out.top_logprobs, out.logprobs):
        assert [t for t, _ in alts] == best.indices.tolist()  # ... not the alternatives or the logprob
        assert [v for _, v in alts] == pytest.approx(best.values.tolist(), abs=1e-6)
        assert lp == pytest.approx(ref[7].item(), abs=1e-6)


DEGENERATE = [
    dict(top_p=1e-46),
    dict(temperature=1e-30),
    dict(temperature=1e-45),
    dict(temperature=1e30),
    dict(min_p=1.0),
    dict(top_k=1, top_p=1e-46, min_p=1.0),
    dict(logit_bias={t: 100.0 for t in range(8)}),
    dict(logit_bias={t: -100.0 for t in range(8)}, temperature=1e-30),
    dict(repetition_penalty=100.0),
    dict(repetition_penalty=0.01, temperature=1e-38),
    dict(presence_penalty=-2.0, frequency_penalty=2.0),
    dict(temperature=5e-324),
    dict(temperature=1e300),
    dict(top_p=5e-324, min_p=1e-40),
    dict(logit_bias={6: 100.0}, temperature=1e-40),
]


def test_degenerate_values_sample_robustly_beside_a_normal_row():
    normal = SamplingParams(temperature=1.0, seed=5)
    logits_n, [alone] = rows(LOGITS, normal, 1)
    want = sample(logits_n, [alone])
    seqs, logits = [], []
    for fields in DEGENERATE:
        lg, [s] = rows(LOGITS, SamplingParams(**fields), 1, prompt=[0, 1, 2], output=[3, 3])
        seqs.append(s)
        logits.append(lg)
    lg, [again] = rows(LOGITS, normal, 1)
    out = sample(torch.cat(logits + [lg]), seqs + [again])
    assert out.failed == [None] * len(out.failed)
    assert all(0 <= t < len(LOGITS) and math.isfinite(lp) and lp <= 0 for t, lp in zip(out.token_ids, out.logprobs))
    assert out.token_ids[-1] == want.token_ids[0] and out.logprobs[-1] == pytest.approx(want.logprobs[0])
    assert out.token_ids[0] == 0  # top_p 1e-46 (0 in fp32) keeps the top token
    assert out.token_ids[1] == out.token_ids[2] == 0  # a tiny temperature is the argmax
    assert out.token_ids[-2] == 6  # the biased argmax at T=1e-40: its model logprob is about -3e40 ...
    assert -3.5e38 < out.logprobs[-2] < -1e38  # ... reported as a finite fp32 (T clamped to fp32's tiny)


def test_a_row_with_non_finite_logits_or_nothing_to_sample_fails_alone():
    good = SamplingParams(temperature=1.0)
    logits = LOGITS.expand(3, -1).clone()
    logits[1, 2] = float("nan")
    seqs = [Sequence([1], good, torch.Generator().manual_seed(i), frozenset()) for i in range(2)]
    seqs.append(Sequence([1], replace(good, min_tokens=2), torch.Generator(), frozenset(range(8))))
    out = sample(logits, seqs)
    assert out.failed[0] is None and out.failed[1] is not None and out.failed[2] is not None
    assert 0 <= out.token_ids[0] < 8 and math.isfinite(out.logprobs[0])


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(top_k=-1), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=1e3), "repetition_penalty"),
        (dict(logit_bias={1: 101.0}), "logit_bias"),
        (dict(logit_bias={10**7: 1.0}), "logit_bias"),
        (dict(min_tokens=20, max_tokens=4), "min_tokens"),
        (dict(top_logprobs=21), "top_logprobs"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
    ],
)
def test_out_of_range_fields_raise_engine_error_naming_them(fields, name):
    from training.deployment.engine.requests import validate_request

    with pytest.raises(EngineError) as e:
        validate_request([1, 2], SamplingParams(**fields), vocab_size=1000, max_model_len=256)
    assert str(e.value).startswith(name)


# ---------------------------------------------------------------- the engine on the tiny model


def run_engine(path: str, body, **kw):
    async def main():
        eng = AsyncEngine(EngineConfig(model=path, max_batch_size=16, max_model_len=256, **kw))
        await eng.start()
        try:
            return await body(eng)
        finally:
            await eng.shutdown()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def hf_greedy(model, prompt, n, **kw) -> list[int]:
    kw.setdefault("eos_token_id", None)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt) :].tolist()


def test_greedy_with_penalty_bias_and_min_tokens_matches_transformers(tiny_model_path, hf_model):
    plain = hf_greedy(hf_model, PROMPT, 12)  # the random tiny model repeats its last token
    stop = plain[0]

    async def body(eng):
        g = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
        return await asyncio.gather(
            eng.generate(PROMPT, SamplingParams(**g, repetition_penalty=1.8)),
            eng.generate(PROMPT, SamplingParams(**g, logit_bias={5: 3.0, plain[0]: -4.0})),
            eng.generate(PROMPT, SamplingParams(**g, stop_token_ids=[stop], min_tokens=4)),
            eng.generate(PROMPT, SamplingParams(**g, stop_token_ids=[stop])),
        )

    rep, bias, min_tok, no_min = run_engine(tiny_model_path, body)
    assert rep.output_token_ids == hf_greedy(hf_model, PROMPT, 12, repetition_penalty=1.8) != plain
    assert bias.output_token_ids == hf_greedy(hf_model, PROMPT, 12, sequence_bias={(5,): 3.0, (plain[0],): -4.0})
    assert bias.output_token_ids != plain
    ref = hf_greedy(hf_model, PROMPT, 12, min_new_tokens=4, eos_token_id=stop)
    ref = ref[: ref.index(stop) + 1] if stop in ref else ref
    assert min_tok.output_token_ids == ref
    assert len(min_tok.output_token_ids) > 4 and stop not in min_tok.output_token_ids[:4]
    assert no_min.output_token_ids == [stop] and no_min.stop_reason == stop


def test_logprobs_under_every_field_are_the_models_at_temperature(tiny_model_path, hf_model):
    fields = dict(max_tokens=10, temperature=0.7, seed=2, ignore_eos=True, top_logprobs=4)

    async def body(eng):
        return await asyncio.gather(
            *[
                eng.generate(PROMPT, SamplingParams(**fields, **extra))
                for extra in (
                    dict(),
                    dict(top_k=3, min_p=0.05),
                    dict(presence_penalty=1.0, frequency_penalty=0.5),
                    dict(repetition_penalty=1.5, logit_bias={9: 5.0}, min_tokens=3),
                )
            ]
        )

    for res in run_engine(tiny_model_path, body):
        with torch.no_grad():
            logits = hf_model(torch.tensor([PROMPT + res.output_token_ids])).logits[0, len(PROMPT) - 1 : -1]
        ref = torch.log_softmax(logits / 0.7, -1)
        got = torch.tensor(res.output_logprobs)
        assert torch.allclose(got, ref.gather(1, torch.tensor(res.output_token_ids)[:, None])[:, 0], atol=1e-4)
        best = ref.topk(4)
        for alts, ids, vals in zip(res.output_top_logprobs, best.indices, best.values):
            assert [t for t, _ in alts] == ids.tolist()
            assert [v for _, v in alts] == pytest.approx(vals.tolist(), abs=1e-4)


def test_seeded_request_samples_the_same_whatever_its_neighbours_ask(tiny_model_path):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=77, ignore_eos=True)
    neighbours = [
        dict(top_k=5),
        dict(top_p=0.3),
        dict(min_p=0.2),
        dict(repetition_penalty=2.0),
        dict(logit_bias={3: 10.0}),
        dict(top_logprobs=5),
        dict(temperature=0.0),
        dict(min_tokens=5),
    ]

    async def body(eng):
        alone = await eng.generate(PROMPT, params)
        crowd = [eng.generate(PROMPT[:6], SamplingParams(max_tokens=25, ignore_eos=True, **kw)) for kw in neighbours]
        crowded, *_ = await asyncio.gather(eng.generate(PROMPT, params), *crowd)
        return alone, crowded

    alone, crowded = run_engine(tiny_model_path, body)
    assert alone.output_token_ids == crowded.output_token_ids
    assert alone.output_logprobs == pytest.approx(crowded.output_logprobs, abs=1e-5)


def test_stop_reason_names_the_stop_string_or_stop_token(tiny_model_path):
    async def body(eng):
        sampled = dict(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
        full = await eng.generate(PROMPT, SamplingParams(**sampled))
        k = next(i for i in range(10, len(full.text) - 3) if full.text.find(full.text[i : i + 3]) == i)
        stop = full.text[k : k + 3]
        by_str = await eng.generate(PROMPT, SamplingParams(**sampled, stop=["never-there", stop]))
        kept = await eng.generate(PROMPT, SamplingParams(**sampled, stop=[stop], include_stop_str_in_output=True))
        tok = full.output_token_ids[5]
        by_tok = await eng.generate(PROMPT, SamplingParams(**sampled, stop_token_ids=[tok]))
        return full, stop, by_str, kept, tok, by_tok

    full, stop, by_str, kept, tok, by_tok = run_engine(tiny_model_path, body)
    assert full.stop_reason is None and full.finish_reason == "length"
    assert by_str.finish_reason == "stop" and by_str.stop_reason == stop
    assert by_str.text == full.text[: full.text.find(stop)]
    assert kept.text == full.text[: full.text.find(stop) + len(stop)] and kept.stop_reason == stop
    assert by_tok.stop_reason == tok and by_tok.output_token_ids[-1] == tok


def test_a_sequence_that_fails_inside_a_step_fails_alone(tiny_model_path, hf_model):
    """Injected fault (validation makes it impossible for real): a row whose logit_bias names a token
    outside the vocabulary makes the batched sampler raise; only that sequence fails."""

    async def body(eng):
        good = [
            eng.generate(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            for p in (PROMPT, PROMPT[:5], [42] * 7)
        ]
        bad = eng.engine.make_sequence(
            PROMPT,
            SamplingParams(max_tokens=8, ignore_eos=True),
            None,
            eng._deliver(fut := asyncio.get_running_loop().create_future()),
        )
        bad.params = replace(bad.params, logit_bias={10**9: 1.0})
        eng._post(AddRequest(bad))  # past the validation generate() would do
        results = await asyncio.gather(*good)
        with pytest.raises(SequenceFailedError):
            await fut
        return results, eng.stats()

    results, stats = run_engine(tiny_model_path, body)
    for prompt, res in zip((PROMPT, PROMPT[:5], [42] * 7), results):
        assert res.output_token_ids == hf_greedy(hf_model, prompt, 8)
    assert stats["requests_failed"] == 1 and stats["running"] == 0 and stats["kv_cache"]["blocks_used"] == 0


def test_a_row_with_a_sampling_field_the_c_sampler_does_not_know_goes_to_the_torch_sampler(monkeypatch):
    """The C sampler takes a row only when every field it sets is one the C path handles: a field added to
    SamplingParams (here by a subclass, as a new field would be) and set on a row sends the batch to the
    torch sampler instead of being silently ignored; left at its default it does not."""
    from dataclasses import dataclass

    from training.deployment.engine import token_sampler

    @dataclass
    class WithNewField(SamplingParams):
        typical_p: float = 1.0

    calls = []
    real = token_sampler.sample_plain
    monkeypatch.setattr(token_sampler, "sample_plain", lambda *a: calls.append(1) or real(*a))
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    batch, seqs = rows(logits, WithNewField(temperature=0.8, seed=3, stop=["x"], max_tokens=5), 4)
    sample(batch, seqs, native=True)
    assert calls == [1]  # the new field at its default, and only fields the C path handles set

    calls.clear()
    batch, seqs = rows(logits, WithNewField(temperature=0.8, typical_p=0.5), 4)
    out = sample(batch, seqs, native=True)
    assert calls == [] and out.failed == [None] * 4
    assert not token_sampler._plain(WithNewField(typical_p=0.5))
    assert not token_sampler._plain(SamplingParams(top_logprobs=2))
    assert token_sampler._plain(SamplingParams(temperature=0.5, stop_token_ids=[3], ignore_eos=True))
