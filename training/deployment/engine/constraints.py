"""Constrained decoding: a grammar per sequence, its token mask on the logits, the matcher advanced per token.

A :class:`Constraint` (``SamplingParams.constraint``) says the output is ``prefix`` + one JSON value
matching ``schema`` + ``suffix`` (compact one-line JSON: ``", "`` and ``": "`` separators, no other
whitespace, so a sampled document cannot grow by whitespace alone). llguidance (the optional extra
``training[constrained]``) compiles it and gives the allowed tokens of each step.

Contract with the sampler (``engine.py`` calls :meth:`GrammarMasks.apply` before ``token_sampler.sample``):
- every token the grammar does not allow next gets logit -inf in that row, before logit_bias,
  penalties, temperature and truncation, so the reported logprob ``log_softmax(masked / T)`` is
  the distribution the token was drawn from;
- the stop tokens of the sequence (eos unless ``ignore_eos``, ``stop_token_ids``) are allowed
  exactly when the grammar is complete (accepting), whatever the library thinks eos is;
- after each sampled token :meth:`Matcher.advance` moves the grammar; it returns True when the grammar
  is complete and allows nothing more, and the engine ends the sequence there (``stop``, no eos token).

Rows without a constraint cost nothing: the engine checks ``params.constraint`` per row and calls
nothing else. The library's tokenizer is built once per engine, at the first constrained request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import torch

LIBRARY = "llguidance"
"""The grammar library (measured against xgrammar: engine README, "Constrained decoding")."""
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options: one line, with ``json.dumps``' separators (as Hermes tool calls are written)."""


@dataclass(frozen=True)
class Constraint:
    """The output must be ``prefix`` + one JSON value matching ``schema`` + ``suffix`` (then it ends)."""

    schema: dict
    """A JSON schema (``{"type": "object"}`` for any object)."""
    prefix: str = ""
    suffix: str = ""

    def grammar(self) -> str:
        """The llguidance grammar (Lark with an inline ``%json`` rule)."""
        import llguidance

        schema = {**self.schema, "x-guidance": JSON_FORMAT}
        parts = [json.dumps(self.prefix)] if self.prefix else []
        parts.append("value")
        if self.suffix:
            parts.append(json.dumps(self.suffix))
        lark = f"start: {' '.join(parts)}\nvalue: %json {json.dumps(schema)}\n"
        return llguidance.LLMatcher.grammar_from_lark(lark)


def missing_library() -> Optional[str]:
    """None when constrained decoding can run here, else why not (names the package to install)."""
    try:
        import llguidance  # noqa: F401
        import llguidance.hf  # noqa: F401
    except ImportError:
        return (
            f"constrained decoding (tool_choice 'required' or a named tool, response_format json_object / "
            f"json_schema) needs the '{LIBRARY}' package: pip install 'training[constrained]'"
        )
    return None


def check_constraint(constraint: Any) -> Optional[str]:
    """None when ``constraint`` compiles, else what is wrong (missing library, bad schema)."""
    if not isinstance(constraint, Constraint):
        return f"expected a Constraint, got {type(constraint).__name__}"
    if not isinstance(constraint.schema, dict):
        return f"schema must be a JSON schema object, got {type(constraint.schema).__name__}"
    missing = missing_library()
    if missing is not None:
        return missing
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(constraint.grammar())
    except Exception as e:  # a schema the library cannot even serialise
        error = f"{type(e).__name__}: {e}"
    return f"the grammar does not compile: {error.strip()}" if error else None


class Matcher:
    """One sequence's grammar state: the allowed next tokens, advanced with each sampled token."""

    def __init__(self, matcher: Any, vocab_size: int, stop_ids: frozenset[int], library_eos: list[int]):
        self._m = matcher
        self.vocab_size = vocab_size
        self.stop_ids = sorted(t for t in stop_ids if t < vocab_size)
        self._library_eos = library_eos

    def allowed(self) -> torch.Tensor:
        """Bool mask over the vocabulary (CPU) of the tokens the grammar allows next."""
        import llguidance.torch

        bits = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        llguidance.torch.fill_next_token_bitmask(self._m, bits, 0)
        shifts = torch.arange(32, dtype=torch.int32)
        mask = ((bits[0][:, None] >> shifts) & 1).bool().flatten()[: self.vocab_size]
        mask[self._library_eos] = False  # ending is decided below, with this sequence's own stop tokens
        if self._m.is_accepting():
            mask[self.stop_ids] = True
        return mask

    def advance(self, token: int) -> bool:
        """Consume ``token``; True when the grammar is now complete and allows nothing more.

        A stop token ends the sequence anyway and is not consumed. Raises ValueError when the
        grammar refuses the token (it was masked, so this is a bug).
        """
        if token in self.stop_ids:
            return False
        if not self._m.consume_token(token):
            raise ValueError(f"the grammar refused token {token}: {self._m.get_error()}")
        return self._m.is_stopped()


class GrammarMasks:
    """Per engine: builds each constrained sequence's :class:`Matcher` and masks its logits row."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer = None

    def matcher(self, constraint: Constraint, stop_ids: frozenset[int]) -> Matcher:
        """A fresh matcher at the start of the output; ValueError naming the problem if it does not compile."""
        import llguidance
        import llguidance.hf

        if self._ll_tokenizer is None:  # seconds for a 50k vocabulary: once per engine
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        m = llguidance.LLMatcher(self._ll_tokenizer, constraint.grammar())
        if m.is_error():
            raise ValueError(f"constraint: the grammar does not compile: {m.get_error()}")
        eos = self._ll_tokenizer.eos_token
        return Matcher(m, self.vocab_size, stop_ids, [eos] if 0 <= eos < self.vocab_size else [])

    def apply(self, logits: torch.Tensor, seqs: list) -> tuple[torch.Tensor, list[Optional[str]]]:
        """``logits`` with -inf outside each constrained row's allowed tokens (a copy); per row, why its
        matcher could not be built (that row is then fully masked), else None."""
        out = logits.clone()
        errors: list[Optional[str]] = [None] * len(seqs)
        for i, seq in enumerate(seqs):
            if seq.params.constraint is None:
                continue
            try:
                if seq.matcher is None:
                    seq.matcher = self.matcher(seq.params.constraint, seq.stop_ids)
                allowed = seq.matcher.allowed()
            except Exception as e:
                errors[i] = f"{type(e).__name__}: {e}"
                out[i] = float("-inf")
                continue
            out[i].masked_fill_(~allowed.to(out.device), float("-inf"))
        return out, errors
