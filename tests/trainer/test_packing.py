"""Packing: whole sequences, token budget, positions, gather alignment, no cross-sequence attention."""

import random

import pytest
import torch

from training.trainer.logprobs import packed_logprobs
from training.trainer.model import load_causal_lm
from training.trainer.packing import pack_sequences


def _random_sequences(lengths, seed=0, vocab=400):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def test_packing_keeps_sequences_whole_and_respects_budget():
    lengths = [5, 30, 17, 60, 1, 99, 40, 3, 250, 12]
    sequences = _random_sequences(lengths)
    batches = pack_sequences(sequences, max_tokens=100)
    seen = sorted(i for b in batches for i in b.sample_indices)
    assert seen == list(range(len(sequences))), "every sequence packed exactly once"
    for b in batches:
        assert b.num_tokens == sum(b.lengths)
        assert b.num_tokens <= 100 or (b.num_sequences == 1 and b.lengths[0] > 100)
        for seq_tokens, i in zip(b.split(b.input_ids_N), b.sample_indices):
            assert seq_tokens.tolist() == sequences[i]  # contiguous and unsplit
        expected_positions = [p for n in b.lengths for p in range(n)]
        assert b.position_ids_N.tolist() == expected_positions
        expected_index = [s for s, n in enumerate(b.lengths) for _ in range(n)]
        assert b.sequence_index_N.tolist() == expected_index
        assert b.input_ids_N.dtype == b.position_ids_N.dtype == b.sequence_index_N.dtype == torch.long


def test_oversize_sequence_gets_its_own_micro_batch():
    sequences = _random_sequences([10, 150, 20])
    batches = pack_sequences(sequences, max_tokens=64)
    oversize = [b for b in batches if 1 in b.sample_indices]
    assert len(oversize) == 1 and oversize[0].sample_indices == [1] and oversize[0].num_tokens == 150
    assert any(b.sample_indices == [0, 2] for b in batches), "the two small ones share a micro-batch"


def test_first_fit_fills_earlier_bins():
    sequences = _random_sequences([60, 60, 30, 40])
    batches = pack_sequences(sequences, max_tokens=100)
    assert [b.sample_indices for b in batches] == [[0, 2], [1, 3]]


def test_bad_input_is_rejected_with_field_name():
    with pytest.raises(ValueError, match="max_tokens"):
        pack_sequences([[1, 2]], max_tokens=0)
    with pytest.raises(ValueError, match=r"sequences\[1\]"):
        pack_sequences([[1, 2], []], max_tokens=10)


def test_gather_aligns_per_token_lists_and_scalars():
    sequences = _random_sequences([3, 4, 2])
    per_token = [[float(100 * i + t) for t in range(len(s))] for i, s in enumerate(sequences)]
    scalars = [10.0, 20.0, 30.0]
    batches = pack_sequences(sequences, max_tokens=6)  # [0, 2] and [1]
    assert [b.sample_indices for b in batches] == [[0, 2], [1]]
    first = batches[0]
    assert first.gather(per_token).tolist() == [0.0, 1.0, 2.0, 200.0, 201.0]
    assert first.gather(scalars).tolist() == [10.0, 10.0, 10.0, 30.0, 30.0]
    assert first.gather([[1, 0, 1], None, [0, 1]], dtype=torch.long).dtype == torch.long
    with pytest.raises(ValueError, match=r"per_sample\[2\]"):
        first.gather([[1.0, 2.0, 3.0], None, [1.0]])


def test_attention_mask_is_block_diagonal_causal():
    batch = pack_sequences([[1, 2], [3, 4, 5]], max_tokens=10)[0]
    allowed = batch.attention_mask(torch.bool)[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    additive = batch.attention_mask(torch.float32)[0, 0]
    assert torch.equal(additive == 0, torch.tensor(allowed, dtype=torch.bool))


@pytest.fixture(scope="module")
def plain_sdpa_model(tiny_model_path):
    return load_causal_lm(tiny_model_path, "cpu", torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("attn", ["packed_sdpa", "sdpa", "eager"])
def test_no_attention_across_sequences_in_a_pack(tiny_model_path, plain_sdpa_model, attn):
    """Changing one sequence's tokens leaves every other sequence's logprobs in the pack unchanged,
    and each packed sequence scores as a plain unpacked forward of that sequence alone."""
    model = load_causal_lm(tiny_model_path, "cpu", torch.float32, attn_implementation=attn).eval()
    assert model.config._attn_implementation == attn
    sequences = _random_sequences([7, 13, 1, 9])
    changed = [list(s) for s in sequences]
    changed[1] = [(t + 17) % 400 for t in changed[1]]
    with torch.no_grad():
        base = pack_sequences(sequences, 100)[0]
        other = pack_sequences(changed, 100)[0]
        assert base.num_sequences == 4
        lp_base = base.split(packed_logprobs(model, base, chunk_tokens=8))
        lp_other = other.split(packed_logprobs(model, other, chunk_tokens=8))
        alone = []
        for seq in sequences:
            logp = plain_sdpa_model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
            alone.append(torch.cat([torch.zeros(1), logp[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]]))
    assert not torch.allclose(lp_base[1], lp_other[1]), "the changed sequence itself does change"
    for i in (0, 2, 3):
        torch.testing.assert_close(lp_base[i], lp_other[i], atol=1e-6, rtol=0)
    for i in range(4):
        torch.testing.assert_close(lp_base[i], alone[i], atol=1e-5, rtol=0)


def test_packed_sdpa_without_boundaries_is_plain_sdpa(tiny_model_path, plain_sdpa_model):
    """Outside the trainer's packed call (no cu_seq_lens), packed_sdpa is transformers' sdpa, padding included."""
    model = load_causal_lm(tiny_model_path, "cpu", torch.float32).eval()
    assert model.config._attn_implementation == "packed_sdpa"
    input_ids = torch.tensor(_random_sequences([12, 12], seed=3))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # left padding in the second row
    with torch.no_grad():
        got = model(input_ids, attention_mask=attention_mask).logits
        expected = plain_sdpa_model(input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_packed_sdpa_runs_per_sequence_on_a_pack(tiny_model_path, monkeypatch):
    """On a packed micro-batch the per-sequence path runs (never the dense-mask fallback)."""
    import transformers.integrations.sdpa_attention as sdpa_module

    model = load_causal_lm(tiny_model_path, "cpu", torch.float32).eval()

    def fail(*args, **kwargs):
        raise AssertionError("fell back to dense sdpa")

    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward", fail)
    batch = pack_sequences(_random_sequences([5, 9, 3]), 100)[0]
    with torch.no_grad():
        logprobs_N = packed_logprobs(model, batch, chunk_tokens=4)
    assert logprobs_N.shape == (17,) and torch.isfinite(logprobs_N).all()
