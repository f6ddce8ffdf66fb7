"""The rollout contract: what a user's ``rollout_fn`` returns and what it is given.

Lifecycle: the recipe calls ``make_rollout_fn(setup: RolloutSetup)`` once, then
``await rollout_fn(row)`` ``completions_per_prompt`` times per row. Each call returns a
``RolloutSample`` (one sequence), a ``RolloutRun`` (several segments of one episode that
share one reward), or ``None`` to drop that completion.

Invariants of a ``RolloutSample`` (checked by ``validate_sample`` at the recipe boundary):

- ``tokens``, ``logprobs`` and ``loss_mask`` are parallel lists: index ``t`` of each talks
  about the same token.
- ``loss_mask[t]`` is 1 exactly on tokens the sampler generated for the policy being trained
  and 0 on prompt, user, tool and template tokens. At least one token has mask 1.
- ``logprobs[t]`` is the sampler's logprob of ``tokens[t]`` given ``tokens[:t]`` where the
  mask is 1, and 0.0 elsewhere. Every value is finite.
- ``tokens`` are the exact ids the server produced; never re-tokenized text.
- ``token_weight_versions``, when given, has one entry per trainable token (``loss_mask`` 1),
  in order: the weight version that produced it (``Completion.token_weight_versions`` of each
  call, concatenated).
- ``token_advantages``, when given, is parallel to ``tokens`` too: the advantage A_t each trainable
  token trains with, in place of the group-normalised scalar (values where ``loss_mask`` is 0 are
  never used; write 0.0 there). Every value is finite and ``|A_t| <= MAX_ABS_REWARD``.
- ``reward`` is a real number with ``|reward| <= MAX_ABS_REWARD``: a Python ``int`` / ``float``, or
  a numpy or torch scalar, converted to ``float`` at validation. ``None``, ``nan``, ``inf``, a bool
  or anything larger is refused naming the field (a huge reward would overflow the advantages).
- ``reward_components``, when given, maps component names (metric-safe: letters, digits, ``_ . -``) to rewards
  under the same rule as ``reward``; refused naming the component. They belong to the completion: a
  ``RolloutRun``'s are the run's, written into every segment. ``Config.reward_weights`` may combine them into
  the reward (``training/utils/rl/reward_components.py``).

Submodules of this package: ``sample_builder`` (``SampleBuilder``, the one builder of these samples from
model calls, with the weight-version convention), ``episode_facts`` (``EpisodeFacts``, the typed record
behind an agent run's ``metadata``) and ``turn_matching`` (classifies the calls of a recorded multi-turn
episode as NEW, APPEND or WIPE).

Shape suffixes, the one convention of the whole code base: a list or tensor whose length or
shape is not obvious ends in one capital letter per dimension, outermost first (``logprobs_T``,
``rewards_G``, ``logits_BV``, ``allowed_NN``); shapes in docstrings (``[N]``, ``[B, H, N, D]``)
use the same letters.

=====  ==========================================================================================
``T``  tokens of one sequence (a ``RolloutSample``'s ``tokens`` / ``logprobs`` / ``loss_mask``)
``G``  completions of one prompt group (one reward each: ``rewards_G``, ``PromptGroup.rewards``)
``S``  samples, one sequence each: of a group (several per completion with a ``RolloutRun``) or
       of a packed micro-batch (``rewards_S``, ``sequence_sums`` → ``[S]``)
``N``  tokens of a packed micro-batch, every sequence concatenated (``PackedBatch.input_ids_N``)
``C``  rows of a shared-prefix compute layout (``SharedPrefixLayout.input_ids_C``)
``M``  predicted (hidden state, next token) pairs: ``N - 1``, or those of a shared layout (``target_M``)
``B``  batch rows: one per running sequence of an engine step (``sample(logits_BV, ...)``,
       ``u_B``); the leading dimension of attention inputs (``[B, H, N, D]``; 1 when packed)
``V``  the vocabulary (``logits_BV``, ``logits_MV``)
``H``  attention heads (docstring shapes only)
``D``  head dimension (docstring shapes only)
=====  ==========================================================================================

``lora_A`` / ``lora_B`` are ``peft``'s names for the adapter matrices, not shapes.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Union


STOP_REASONS = ("finish", "max_steps", "timeout", "error", "length")
"""Why an agent episode ended (``RolloutRun.metadata["stop_reason"]``): ``finish`` (the agent or its
environment ended it), ``max_steps`` (the environment's step limit), ``timeout`` (cut at its deadline),
``error`` (an exception ended it), ``length`` (the context was full). Failed episodes return no run:
they reach the metrics as failure causes (``timeout`` → ``timeout``, any other cause → ``error``)."""

MAX_ABS_REWARD = 1e6
"""The largest ``|reward|`` the contract accepts (a rollout's and a proxy-posted per-call reward alike):
far above any sensible reward scale, far below where the advantages' squares overflow."""


class RolloutFnError(TypeError):
    """``make_rollout_fn(setup)`` returned something the recipe cannot await (``check_rollout_fn``)."""


class RolloutValidationError(ValueError):
    """A rollout result broke the contract. ``field`` names the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class RolloutSample:
    """One trainable sequence: prompt and completion tokens flattened into one list."""

    tokens: list[int]
    """Token ids of the whole sequence (prompt + every turn), exactly as the server saw them."""
    logprobs: list[float]
    """Sampler logprob per token: the generated token's logprob where ``loss_mask`` is 1, 0.0 elsewhere."""
    loss_mask: list[int]
    """1 on generated (trainable) tokens, 0 on prompt / user / tool / template tokens."""
    reward: float
    """Scalar reward of the whole sequence (or of its run, for a ``RolloutRun`` segment)."""
    finish_reason: str = "stop"
    """Why generation ended: ``stop``, ``length``, ``abort``... (``length`` marks truncation)."""
    text: str = ""
    """Optional decoded text, for logs only: never used to rebuild training data."""
    weight: float = 1.0
    """Scales this sample's per-token loss (>= 0), e.g. ``1 / num_calls`` so a long episode split into many samples counts once."""
    token_weight_versions: Optional[list[int]] = None
    """Optional: per trainable token (``loss_mask`` 1, in order) the weight version that generated it; in-flight
    weight updates mix versions within one completion. Feeds ``offpolicy/token_lag_*``; None when unknown."""
    token_advantages: Optional[list[float]] = None
    """Optional, parallel to ``tokens``: a dense per-token advantage A_t (e.g. a process reward) that the loss uses on
    this sample's ``loss_mask`` tokens instead of the group-normalised advantage of ``reward``; None = that scalar
    on every token. The recipe's on-policy distillation builds one per sample (``training/utils/rl/distillation.py``)."""
    reward_components: Optional[dict[str, float]] = None
    """Optional named parts of the reward (``{"correct": 1.0, "format": 0.5}``), each a finite number like ``reward``:
    logged per step (``rollout/reward/<name>_mean``) and in ``rollouts.jsonl``; with ``Config.reward_weights`` the
    trained reward is their weighted sum after per-component group normalisation (``reward_components.py``)."""

    @property
    def num_trainable_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class RolloutRun:
    """Several segments of one episode that share one reward.

    An agent whose context is rebuilt between turns (compaction, a re-rendered prompt that no
    longer extends the previous tokens) cannot be flattened into one sequence; each unbroken
    stretch becomes one segment. All segments get ``reward`` (a segment's own ``reward`` field
    is overwritten) and together count as one completion of the prompt group.
    """

    segments: list[RolloutSample]
    """The segments in episode order; at least one."""
    reward: float
    """The episode's reward, given to every segment."""
    segment_rewards: bool = False
    """Keep each segment's own ``reward`` (per-call credit assignment) instead of writing ``reward`` into all;
    the group's advantage statistics still come from the runs' ``reward`` (formula: ``advantages.py``)."""
    return_weights: Optional[list[float]] = None
    """With ``segment_rewards``: g_k, the share of ``reward`` credited to segment k (1 for the same return,
    gamma**(K-1-k) discounted); the rest of the segment's reward is its per-call reward. None = 1 each."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-able facts about the episode (turn labels, timings): written to ``rollouts.jsonl``, never trained.
    Documented keys (``training/utils/rl/run_metrics.py`` counts them) include ``stop_reason``: why the
    episode ended, one of ``STOP_REASONS`` (``finish_reason`` stays the sampler's reason for one call)."""
    reward_components: Optional[dict[str, float]] = None
    """Optional named parts of the episode's reward (as ``RolloutSample.reward_components``): the completion's
    components, written into every segment (a segment may not carry different ones of its own)."""

    def samples(self) -> list[RolloutSample]:
        """The segments, with the run's reward written into each unless ``segment_rewards``."""
        if not self.segment_rewards:
            for seg in self.segments:
                seg.reward = self.reward
        if self.reward_components is not None:
            for seg in self.segments:
                seg.reward_components = self.reward_components
        return list(self.segments)


RolloutResult = Union[RolloutSample, RolloutRun, None]
RolloutFn = Callable[[dict], Awaitable[RolloutResult]]


@dataclass
class RolloutSetup:
    """What the recipe hands ``make_rollout_fn`` once, before the first rollout."""

    sampler: Any
    """A ``training.deployment.client.DeploymentSampler`` bound to the deployment."""
    tokenizer: Any
    """The policy's Hugging Face tokenizer (for chat templates and stop ids; never to re-tokenize outputs)."""
    sampling_kwargs: dict[str, Any] = field(default_factory=dict)
    """Defaults for every sampling call (``max_tokens``, ``temperature``, ...), from the recipe config."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Anything the user passed to ``main(..., rollout_extras=...)``."""
    max_seq_len: Optional[int] = None
    """The longest sequence (prompt + completion) the trainer will accept."""
    weight_sync_hooks: list[tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]] = field(
        default_factory=list
    )
    """``(before, after)`` async callables the recipe awaits around every weight sync (a proxy pauses new calls)."""
    proxy_config: Any = None
    """The recipe's ``Config.proxy`` (a ``training.utils.config.ProxyConfig``: the deadlines a proxy rollout
    function's server takes); None outside a recipe (the proxy's defaults)."""

    @property
    def sample_kwargs(self) -> dict[str, Any]:
        """The documented name of ``sampling_kwargs``: the same dict, not a copy."""
        return self.sampling_kwargs


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def as_reward(value: Any, field_name: str = "reward") -> float:
    """``value`` as a float reward, or ``RolloutValidationError`` naming ``field_name``.

    Accepts a Python int / float and a numpy or torch scalar (a 0-d array or a one-element tensor:
    anything with ``.item()`` giving a number); refuses ``None``, bools, non-finite values and
    ``|value| > MAX_ABS_REWARD``."""
    raw = value
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, float):
        raise RolloutValidationError(
            field_name, f"{raw!r} ({type(raw).__name__}) is not a number; return a float (e.g. 1.0 for a pass)"
        )
    if not math.isfinite(value):
        raise RolloutValidationError(field_name, f"{raw!r} is not a finite number")
    if abs(value) > MAX_ABS_REWARD:
        raise RolloutValidationError(
            field_name, f"{raw!r} is out of range: |{field_name}| must be <= MAX_ABS_REWARD={MAX_ABS_REWARD:g}"
        )
    return value


COMPONENT_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
"""What a reward component's name may be: it becomes part of a metric name (``rollout/reward/<name>_mean``)."""


def as_reward_components(value: Any) -> Optional[dict[str, float]]:
    """``value`` (a ``reward_components`` field) as ``{name: float}``, or ``RolloutValidationError``: None passes; a
    dict needs one entry or more, each name matching ``COMPONENT_NAME`` and each value what ``as_reward`` accepts
    (the error names the component: ``reward_components['format']``)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise RolloutValidationError(
            "reward_components", f"{value!r} is not a non-empty dict of name -> float (or None for no components)"
        )
    out: dict[str, float] = {}
    for name, v in value.items():
        if not isinstance(name, str) or not COMPONENT_NAME.fullmatch(name):
            raise RolloutValidationError(
                "reward_components", f"name {name!r} is not a metric-safe string (letters, digits, '_', '.', '-')"
            )
        out[name] = as_reward(v, f"reward_components[{name!r}]")
    return out


def check_rollout_fn(rollout_fn: Any) -> None:
    """Refuse at start what cannot be a rollout function: not callable, or a plain (non-``async``) function."""
    if not callable(rollout_fn):
        raise RolloutFnError(
            f"make_rollout_fn(setup) returned {type(rollout_fn).__name__}, not a function: "
            "return an `async def rollout_fn(row)`"
        )
    target = rollout_fn
    while isinstance(target, functools.partial):
        target = target.func
    if not inspect.isroutine(target):
        target = type(target).__call__  # an object with a __call__ method
    if inspect.isfunction(target) or inspect.ismethod(target):
        if not (inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target)):
            name = getattr(target, "__name__", repr(target))
            if name != "<lambda>":  # a lambda may return a coroutine: it is awaited, and checked then
                raise RolloutFnError(
                    f"rollout_fn: {name} is a plain `def`; declare it `async def {name}(row)` (the recipe awaits it)"
                )


def validate_sample(sample: RolloutSample, vocab_size: Optional[int] = None) -> None:
    """Raise ``RolloutValidationError`` naming the first field that breaks the contract."""
    if not isinstance(sample, RolloutSample):
        raise RolloutValidationError(
            "rollout result", f"expected RolloutSample, RolloutRun or None, got {type(sample).__name__}"
        )
    n = len(sample.tokens)
    if n == 0:
        raise RolloutValidationError("tokens", "empty sequence")
    if len(sample.logprobs) != n:
        raise RolloutValidationError("logprobs", f"length {len(sample.logprobs)} != len(tokens) {n}")
    if len(sample.loss_mask) != n:
        raise RolloutValidationError("loss_mask", f"length {len(sample.loss_mask)} != len(tokens) {n}")
    for i, t in enumerate(sample.tokens):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise RolloutValidationError("tokens", f"tokens[{i}]={t!r} is not a non-negative int")
        if vocab_size is not None and t >= vocab_size:
            raise RolloutValidationError("tokens", f"tokens[{i}]={t} is outside the vocabulary (size {vocab_size})")
    for i, m in enumerate(sample.loss_mask):
        if m not in (0, 1) or isinstance(m, float):
            raise RolloutValidationError("loss_mask", f"loss_mask[{i}]={m!r}; only 0 and 1 are allowed")
    if sum(sample.loss_mask) == 0:
        raise RolloutValidationError("loss_mask", "no trainable token (all zeros)")
    if sample.loss_mask[0] == 1:
        raise RolloutValidationError(
            "loss_mask", "loss_mask[0] is 1; the first token has no context to be sampled from"
        )
    for i, lp in enumerate(sample.logprobs):
        if not _finite(lp):
            raise RolloutValidationError("logprobs", f"logprobs[{i}]={lp!r} is not finite")
    sample.reward = as_reward(sample.reward)
    sample.reward_components = as_reward_components(sample.reward_components)
    if not _finite(sample.weight) or sample.weight < 0:
        raise RolloutValidationError("weight", f"{sample.weight!r} is not a finite number >= 0")
    if sample.token_advantages is not None:
        if len(sample.token_advantages) != n:
            raise RolloutValidationError(
                "token_advantages", f"length {len(sample.token_advantages)} != len(tokens) {n} (one per token)"
            )
        for i, a in enumerate(sample.token_advantages):
            if not _finite(a) or abs(a) > MAX_ABS_REWARD:
                raise RolloutValidationError(
                    "token_advantages", f"token_advantages[{i}]={a!r} is not a finite number within MAX_ABS_REWARD"
                )
    versions = sample.token_weight_versions
    if versions is not None:
        if len(versions) != sum(sample.loss_mask):
            raise RolloutValidationError(
                "token_weight_versions",
                f"length {len(versions)} != number of trainable "
                f"tokens {sum(sample.loss_mask)} (one version per loss_mask 1)",
            )
        for i, v in enumerate(versions):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise RolloutValidationError(
                    "token_weight_versions", f"token_weight_versions[{i}]={v!r} is not a non-negative int"
                )


def result_reward(result: RolloutResult) -> Optional[float]:
    """The reward of one ``rollout_fn`` result (None for ``None``), or ``RolloutValidationError`` for a
    result of another type or a reward ``as_reward`` refuses; eval reads only this."""
    if result is None:
        return None
    if not isinstance(result, (RolloutSample, RolloutRun)):
        raise RolloutValidationError(
            "rollout result", f"expected RolloutSample, RolloutRun or None, got {type(result).__name__}"
        )
    return as_reward(result.reward)


def flatten_result(result: RolloutResult, vocab_size: Optional[int] = None) -> list[RolloutSample]:
    """Turn one ``rollout_fn`` result into validated samples ([] for ``None``)."""
    if result is None:
        return []
    if isinstance(result, RolloutRun):
        if not result.segments:
            raise RolloutValidationError("segments", "a RolloutRun needs at least one segment")
        result.reward = as_reward(result.reward)
        result.reward_components = as_reward_components(result.reward_components)
        for k, seg in enumerate(result.segments):
            own = getattr(seg, "reward_components", None)
            if own is not None and own != result.reward_components:
                raise RolloutValidationError(
                    "reward_components",
                    f"segment {k} carries its own {own!r}; a RolloutRun's components are the run's "
                    f"(RolloutRun.reward_components={result.reward_components!r})",
                )
        if result.return_weights is not None and (
            len(result.return_weights) != len(result.segments) or not all(_finite(g) for g in result.return_weights)
        ):
            raise RolloutValidationError(
                "return_weights",
                f"{len(result.return_weights)} values for {len(result.segments)} segments, or a non-finite one",
            )
        samples = result.samples()
    elif isinstance(result, RolloutSample):
        samples = [result]
    else:
        raise RolloutValidationError(
            "rollout result",
            f"expected RolloutSample, RolloutRun or None, got {type(result).__name__}"
            + (
                " (build a RolloutSample(tokens=, logprobs=, loss_mask=, reward=) from it)"
                if isinstance(result, dict)
                else ""
            ),
        )
    for s in samples:
        validate_sample(s, vocab_size)
    return samples
