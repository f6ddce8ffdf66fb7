"""Grammar mask cost: xgrammar against llguidance on the SmolLM2 tokenizer (49,152 tokens), CPU.

    python -m benchmarks.grammar_mask_cost [--repeats 5]

For each installed library: the once-per-engine tokenizer setup, the per-request compile of a JSON
schema (a schema not seen before, so no compile cache helps), and the per-token cost of computing
the next-token mask while walking a schema-valid JSON document token by token (median and maximum
over the document's tokens). The baseline of each row is plain temperature sampling of one
49,152-token row by ``token_sampler.sample`` in the same run: a constrained row pays the mask on top
of it. Not part of ``run_all``: it measured the choice of library for constrained decoding (engine
README, "Constrained decoding").
"""

from __future__ import annotations

import json
import time

import torch

from benchmarks.common import base_parser, emit, median, model_path, row

LL_JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance: the compact one-line JSON xgrammar emits with ``any_whitespace=False`` (json.dumps' separators)."""
DOCUMENT = {"name": "Alice Smith", "age": 42, "city": "Paris", "tags": ["a", "bb", "hello world"], "ok": True}


def schema(i: int) -> dict:
    """A tool-parameters-like schema; ``i`` makes each one new (so no compile cache hides the cost)."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "city": {"type": "string", "enum": ["Paris", "Rome", f"City{i}"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "city", "tags", "ok"],
        "additionalProperties": False,
    }


def _xgrammar(tok, vocab: int, repeats: int, ids: list[int]) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0
    compile_s, fill_s = [], []
    mask = xgr.allocate_token_bitmask(1, vocab)
    for r in range(repeats):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema(r)), any_whitespace=False)
        compile_s.append(time.perf_counter() - t0)
        m = xgr.GrammarMatcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            fill_s.append(time.perf_counter() - t0)
            assert m.accept_token(t), "xgrammar refused a token of the schema-valid document"
    return {"setup": setup, "compile": compile_s, "fill": fill_s}


def _llguidance(tok, vocab: int, repeats: int, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = time.perf_counter() - t0
    compile_s, fill_s = [], []
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    for r in range(repeats):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema(r), defaults=LL_JSON_FORMAT)
        m = llguidance.LLMatcher(ll_tok, grammar)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        for t in ids:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(m, mask, 0)
            fill_s.append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
    return {"setup": setup, "compile": compile_s, "fill": fill_s}


def _plain_sample_ms(vocab: int, repeats: int) -> float:
    from training.deployment.engine.requests import SamplingParams
    from training.deployment.engine.sequence import Sequence
    from training.deployment.engine.token_sampler import sample

    logits = torch.randn(1, vocab) * 3
    seq = Sequence([1, 2, 3], SamplingParams(), torch.Generator().manual_seed(0), frozenset({0}))
    times = []
    for r in range(20 * repeats + 1):
        t0 = time.perf_counter()
        sample(logits, [seq])
        if r:
            times.append((time.perf_counter() - t0) * 1e3)
    return median(times)


def main() -> None:
    args = base_parser(__doc__).parse_args()
    from transformers import AutoTokenizer

    started = time.perf_counter()
    repeats = max(args.repeats, 3)
    tok = AutoTokenizer.from_pretrained(model_path("tiny" if args.quick else "smollm2"))
    vocab = len(tok)
    ids = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    base = _plain_sample_ms(vocab, repeats)
    base_name = f"plain sampling of one {vocab}-token row"
    rows = []
    for lib, fn in (("xgrammar", _xgrammar), ("llguidance", _llguidance)):
        try:
            got = fn(tok, vocab, repeats, ids)
        except ImportError:
            continue
        fill = sorted(got["fill"])
        rows += [
            row(
                f"{lib}: next-token mask, median per token", median(fill) * 1e3, "ms (lower is better)", base_name, base
            ),
            row(f"{lib}: next-token mask, worst token", fill[-1] * 1e3, "ms (lower is better)", base_name, base),
            row(f"{lib}: compile a new schema", median(got["compile"]) * 1e3, "ms (lower is better)", base_name, base),
            row(
                f"{lib}: tokenizer setup (once per engine)", got["setup"] * 1e3, "ms (lower is better)", base_name, base
            ),
        ]
    emit(
        "grammar_mask_cost",
        rows,
        started=started,
        repeats=repeats,
        notes=f"vocabulary {vocab}, a {len(ids)}-token JSON document, {torch.get_num_threads()} threads",
    )


if __name__ == "__main__":
    main()
