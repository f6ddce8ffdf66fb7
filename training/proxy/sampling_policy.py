"""Which sampling fields an agent may send through the proxy, and what happens to each.

A recorded call is trained on with the sampler's logprobs as the behaviour policy, so every field
that changes the distribution a token is drawn from must be known to the trainer. The server
reports logprobs of the untouched distribution (a ``logit_bias`` of +100 on " banana" gave
twelve bananas with recorded logprobs near -16), so such a field either is forced to the recipe's
value, or refused with a 400 naming it, or (constrained decoding) recorded on the call with the
call flagged. The full table, the Anthropic route included, is in ``training/proxy/README.md``.

- ``FORCED``: overwritten by the recipe's ``forced_params`` when it sets them (``temperature``,
  ``top_p``); otherwise forwarded. Either way the value the upstream got is in ``CallRecord.sampling``.
- ``REFUSED``: a 400 naming the field unless the value is the neutral one (what the agent would get
  without the field): penalties, biases and truncations the trainer's logprobs do not include.
- ``RECORDED``: forwarded and recorded in ``CallRecord.sampling``; they pick a sample or end a
  sequence, never reshape a token's distribution (``seed``, ``stop``...).
- ``constraint_of``: ``tool_choice`` that forces a call and ``response_format`` other than text
  need constrained decoding (masked logits); forwarded, recorded in ``CallRecord.constraint``; the
  proxy's ``constrained_calls`` switch decides whether such calls train (``train``) or are kept as
  context only (``exclude``, the default). Both, and the switch's meaning, live on the ground floor
  (``training/utils/constrained_calls.py``), shared with the in-process agents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from training.utils.constrained_calls import CONSTRAINED_CALLS, checked_constrained_calls, constraint_of, trains

if TYPE_CHECKING:
    from training.proxy.records import CallRecord

__all__ = ["CONSTRAINED_CALLS", "FORCED", "RECORDED", "REFUSED", "checked_constrained_calls", "constraint_of"]
__all__ += ["flag", "refusal", "sampling_of"]

FORCED = ("temperature", "top_p")
"""Forced to the recipe's ``forced_params`` when set; recorded either way."""

REFUSED: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "top_k": (0, -1),
    "min_p": (0,),
    "min_tokens": (0,),
    "best_of": (1,),
}
"""Field -> its neutral values; any other value is refused with a 400 naming the field (and ``n`` other than 1)."""

RECORDED = ("seed", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output")
"""Forwarded unchanged and recorded on the call."""


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    if value is None:
        return True
    return not isinstance(value, bool) and any(value == n for n in neutral)


def refusal(body: dict) -> Optional[tuple[str, str]]:
    """The first field of ``body`` that would change the sampled distribution unseen: (field, message), or None."""
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        return "n", "'n' must be 1 behind the training proxy (one recorded choice per call)"
    for name, neutral in REFUSED.items():
        if name in body and not _neutral(body[name], neutral):
            return name, (
                f"'{name}'={body[name]!r} is refused behind the training proxy: it changes the sampled "
                f"distribution, which the recorded logprobs would not show (accepted: {' or '.join(map(repr, neutral))}; "
                "see the proxy README's sampling-field table)"
            )
    return None


def sampling_of(fwd: dict) -> dict[str, Any]:
    """The forced and recorded fields as the upstream got them (what ``CallRecord.sampling`` holds)."""
    return {k: fwd[k] for k in FORCED + RECORDED if fwd.get(k) is not None}


def flag(record: "CallRecord", upstream_body: dict, body: dict, constrained_calls: str) -> None:
    """Fill ``record.sampling``, ``record.constraint`` and ``record.trainable`` from what was sent."""
    record.sampling = sampling_of(upstream_body)
    record.constraint = constraint_of(body)  # chat, and completions with response_format or a forced tool_choice
    record.trainable = trains(record.constraint, constrained_calls)
