"""Trajectory collect engine: one agent-environment episode through the sampler, token-in/token-out.

Prompt construction (never re-tokenizes what the model generated):

- turn 0: ``prompt_0 = chat_template(messages, tools=schemas, add_generation_prompt=True)``;
- turn k+1: ``prompt_{k+1} = prompt_k + output_k + glue_k``, where ``output_k`` are the server's
  generated ids and ``glue_k`` is the template text rendered *after* a stub assistant reply:
  ``render(history + [assistant: STUB] + new_messages)[after STUB]``, tokenized on its own.
  When the model stopped on a token that equals the glue's first token (the end-of-turn
  token it emitted itself), that glue token is dropped: the model's token is kept.

So every prompt sent is a prefix of the final ``tokens``; ``loss_mask`` is 1 exactly on the
generated ids (with the sampler's logprobs) and 0 on the first prompt, tool results and glue.

Segments: when ``agent.compact()`` returns new messages, the context is rebuilt from them and
the token prefix breaks; the episode then has several segments (a ``RolloutRun``).

Over-length: with ``limit = min(max_total_tokens, max_model_len)``, a turn's ``max_tokens`` is
clipped to the room left; when no room is left (or the next glue would not fit) the episode
stops, keeps what it has, ``finish_reason = "length"``, and ``env.truncate`` scores it.
Failures: sampler errors and agent exceptions propagate (the recipe drops the sample and
counts it); tool failures never do (they are observations, see ``tools.ToolManager``).

Stop reason (``Episode.stop_reason``, ``metadata["stop_reason"]``, one of ``STOP_REASONS``):
``finish`` (the environment ended the episode: a ``finish`` call or a reply taken as the answer),
``max_steps`` (the environment's step limit), ``length`` (over-length); ``timeout`` and ``error``
are episodes that did not finish (``Orchestrator``'s ``TrajectoryGroup.stop_reasons``; in the
recipe, failure causes). ``finish_reason`` stays the sampler's reason for its last call.

Constrained calls (``agent.constraint_fields(turn)``: a forced ``tool_choice``, a JSON ``response_format``)
are sent with those fields (and the tool schemas, for the call's grammar) and sampled under the server's
constrained decoding; ``turns[k]["constraint"]`` records them. ``constrained_calls="exclude"`` (default) keeps
such a call's output as context (mask 0, logprob 0.0) and gives it no transitions sample (its credit is
still computed over every call); ``"train"`` trains it with the masked logprobs the server returned.

Modes (``Episode.to_result(mode=...)``): ``stitch`` (default) gives the segments, each trained
with the return (the sum of step rewards); ``transitions`` gives one sample per model call
(``training/utils/rl/credit.py``): call k's exact prompt ids (mask 0) and output ids (mask 1),
reward ``g_k·R + i_k`` with R the final reward, g_k, i_k from ``credit_fn(turns, R)`` (default
g = 1, i = 0) and i_k also holding call k's intermediate reward (tool status,
``IntermediateRewards``), weight ``1 / n``; the run's reward is R.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from training.agents.agents import ConversationAgent
from training.agents.environments import Environment
from training.utils.constrained_calls import checked_constrained_calls, constraint_of, trains
from training.openai_api.tool_parsers import messages_with_tools, render_prompt_ids
from training.utils.rl.credit import TRANSITIONS, CallTokens, CreditFn, credit_parts, transitions_of
from training.utils.rl.rollout import STOP_REASONS, RolloutRun, RolloutSample

MODES = ("stitch", TRANSITIONS)
"""How an episode becomes training data (``Episode.to_result``): segments, or one sample per call."""

STUB = "<<assistant-reply-stub-5c1e>>"
"""Placeholder assistant content used to locate the template glue in a rendering."""


class TemplateGlueError(ValueError):
    """The chat template did not render the stub assistant reply, so the glue cannot be located."""


@dataclass
class Segment:
    """One unbroken token sequence under construction (parallel lists)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    token_weight_versions: list[int] = field(default_factory=list)
    """Per generated token (``loss_mask`` 1), the weight version that produced it."""
    start_turn: int = 0
    reason: str = "start"
    """Why this segment began: ``start`` or ``compaction``."""

    def add_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)

    def add_generated(self, ids: list[int], logprobs: list[float], weight_versions: list[int]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"logprobs: {len(logprobs)} values for {len(ids)} generated tokens")
        if len(ids) != len(weight_versions):
            raise ValueError(f"weight_versions: {len(weight_versions)} values for {len(ids)} generated tokens")
        self.tokens += ids
        self.logprobs += [float(x) for x in logprobs]
        self.loss_mask += [1] * len(ids)
        self.token_weight_versions += [int(v) for v in weight_versions]

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Episode:
    """A finished episode: its segments, return and transcript."""

    segments: list[RolloutSample]
    """Segments with at least one generated token, in order."""
    reward: float
    """The return: the sum of step rewards (final reward + intermediate rewards)."""
    finish_reason: str
    """The sampler's finish reason of the last call (``length`` when the episode was cut)."""
    metadata: dict[str, Any]
    """JSON-able transcript: ``turns`` (timings, statuses, rewards), ``segments``, ``messages``, ``return``,
    ``stop_reason``, ``intermediate_rewards``."""
    prompts: list[list[int]] = field(default_factory=list)
    """Every prompt sent to the sampler, in order (for checks; not logged)."""
    stop_reason: str = "finish"
    """Why the episode ended: ``finish``, ``max_steps`` or ``length`` (``STOP_REASONS``)."""
    calls: list[CallTokens] = field(default_factory=list)
    """Every model call's exact prompt and output ids, in order (for ``transitions``)."""
    final_reward: float = 0.0
    """R: the environment's score of the answer (the return without intermediate rewards)."""
    intermediate: list[float] = field(default_factory=list)
    """Per call, its intermediate reward (tool status); ``reward == final_reward + sum(intermediate)``."""
    trainable_calls: list[bool] = field(default_factory=list)
    """Per call, whether it trains (False: constrained under ``constrained_calls="exclude"``); empty = all do."""

    def to_result(
        self,
        as_run: bool = False,
        *,
        mode: str = "stitch",
        credit_fn: Optional[CreditFn] = None,
        max_seq_len: Optional[int] = None,
    ) -> Union[RolloutSample, RolloutRun, None]:
        """``None`` when nothing was generated. ``stitch``: one segment -> ``RolloutSample`` (unless
        ``as_run``), else ``RolloutRun`` (carrying ``metadata``). ``transitions``: a ``RolloutRun`` of one
        sample per call (module docstring), cut to ``max_seq_len``."""
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {MODES}")
        if mode == TRANSITIONS:
            return self.transitions(credit_fn, max_seq_len=max_seq_len)
        if not self.segments:
            return None
        for s in self.segments:
            s.reward = self.reward
        if len(self.segments) == 1 and not as_run:
            return self.segments[0]
        return RolloutRun(segments=list(self.segments), reward=self.reward, metadata=dict(self.metadata, mode="stitch"))

    def transitions(
        self, credit_fn: Optional[CreditFn] = None, *, max_seq_len: Optional[int] = None
    ) -> Optional[RolloutRun]:
        """One sample per model call: reward g_k·R + i_k (R = ``final_reward``; i_k = the credit's own
        plus the call's intermediate reward), weight ``1 / n``; None when no call generated a token."""
        turns = self.metadata.get("turns", [])
        shares, intermediate = credit_parts(credit_fn, turns, self.final_reward, extra=self.intermediate)
        keep = [k for k in range(len(self.calls)) if not self.trainable_calls or self.trainable_calls[k]]
        res = transitions_of(  # credit over every call; an excluded constrained call gives no sample
            [self.calls[k] for k in keep],
            [shares[k] for k in keep],
            [intermediate[k] for k in keep],
            self.final_reward,
            max_seq_len=max_seq_len,
        )
        meta = dict(
            self.metadata,
            mode=TRANSITIONS,
            sample_calls=res.calls,
            credited_rewards=res.rewards,
            sample_weights=res.weights,
            return_weights=res.return_weights,
            intermediate_rewards=res.intermediate,
            run_reward=self.final_reward,
        )
        return res.to_run(self.final_reward, meta)


class TrajectoryEngine:
    """Runs agent-environment episodes against a ``DeploymentSampler``."""

    def __init__(
        self,
        sampler: Any,
        tokenizer: Any,
        *,
        max_total_tokens: Optional[int] = None,
        sampling: Optional[dict] = None,
        chat_template_kwargs: Optional[dict] = None,
        constrained_calls: str = "exclude",
    ):
        """``constrained_calls``: ``exclude`` (default) keeps a constrained call's output as context only (mask 0;
        no sample in transitions mode), ``train`` trains it with the masked logprobs
        (``training/utils/constrained_calls.py``, the proxy's switch)."""
        if max_total_tokens is not None and max_total_tokens < 2:
            raise ValueError(f"max_total_tokens: must be >= 2 or None, got {max_total_tokens}")
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.max_total_tokens = max_total_tokens
        self.sampling = dict(sampling or {})
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.constrained_calls = checked_constrained_calls(constrained_calls)

    # ---- rendering -----------------------------------------------------------------------
    def render_prompt(self, messages: list[dict], tools: Optional[list[dict]]) -> list[int]:
        """Token ids of a fresh context (first turn, or after compaction)."""
        return render_prompt_ids(self.tokenizer, messages, tools, **self.template_kwargs)

    def render_glue(self, history: list[dict], new_messages: list[dict], tools: Optional[list[dict]]) -> list[int]:
        """Template tokens between an assistant reply (after ``history``) and the next assistant reply."""
        msgs, tools_arg = messages_with_tools(
            self.tokenizer, history + [{"role": "assistant", "content": STUB}] + new_messages, tools
        )
        text = self.tokenizer.apply_chat_template(
            msgs, tools=tools_arg, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        i = text.rfind(STUB)
        if i < 0:
            raise TemplateGlueError("the chat template dropped the assistant reply; cannot build token-in prompts")
        return list(self.tokenizer.encode(text[i + len(STUB) :], add_special_tokens=False))

    # ---- episode ---------------------------------------------------------------------------
    def _max_new_tokens(self) -> Optional[int]:
        if "max_tokens" in self.sampling:
            return self.sampling["max_tokens"]
        return (getattr(self.sampler, "sampling_defaults", None) or {}).get("max_tokens")

    async def collect(self, agent: ConversationAgent, env: Environment) -> Episode:
        """Run the episode to its end (or to the length limit) and return it."""
        if agent.tools is None:
            agent.tools = env.tool_schemas()
        tools = agent.tools
        limit = self.max_total_tokens
        seg = Segment()
        seg.add_context(self.render_prompt(agent.messages, tools))
        closed: list[Segment] = []
        session = uuid.uuid4().hex
        prompts: list[list[int]] = []
        turns: list[dict] = []
        calls: list[CallTokens] = []
        intermediate: list[float] = []
        trainable_calls: list[bool] = []
        total, final_reward, finish_reason, last_text = 0.0, None, "stop", ""
        stop_reason = "finish"
        t_start = time.perf_counter()
        while True:
            turn = len(turns)
            room = None if limit is None else limit - len(seg.tokens)
            if room is not None and room < 1:
                finish_reason = "length"
                break
            want = self._max_new_tokens()
            sampling = dict(self.sampling)
            if room is not None:
                sampling["max_tokens"] = room if want is None else min(want, room)
            constraint = constraint_of(agent.constraint_fields(turn))
            if constraint is not None:  # a forced call's grammar needs the tool schemas (not rendered again)
                sampling.update(constraint, **({"tools": tools} if "tool_choice" in constraint else {}))
            trainable_calls.append(trains(constraint, self.constrained_calls))
            t0 = time.perf_counter()
            (c,) = await self.sampler.sample_with_prompt_tokens(seg.tokens, n=1, session_id=session, **sampling)
            sample_s = time.perf_counter() - t0
            if c.prompt_tokens != seg.tokens:
                raise RuntimeError("the server's prompt_token_ids differ from the prompt sent (token drift)")
            prompts.append(list(seg.tokens))
            out = c.output_tokens
            versions = c.token_weight_versions or [c.weight_version] * len(out)
            calls.append(
                CallTokens(prompts[-1], list(out), list(c.inference_logprobs), list(versions), c.finish_reason, turn)
            )
            if trainable_calls[-1]:
                seg.add_generated(out, c.inference_logprobs, versions)
            else:  # constrained_calls="exclude": the output is context, never trained on
                seg.add_context(out)
            last_text = self.tokenizer.decode(out, skip_special_tokens=True)
            action = agent.act(last_text)
            t1 = time.perf_counter()
            result = await env.step(action)
            env_s = time.perf_counter() - t1
            total += result.reward
            step_final = result.info.get("final_reward", result.reward) if result.done else 0.0
            intermediate.append(result.reward - step_final)
            new_messages = agent.observe(result)
            turns.append(
                {
                    "turn": turn,
                    "prompt_tokens": c.prompt_len,
                    "output_tokens": len(out),
                    "finish_reason": c.finish_reason,
                    "weight_version": c.weight_version,
                    "cached_tokens": c.cached_tokens,
                    "sample_s": round(sample_s, 4),
                    "env_s": round(env_s, 4),
                    "tool_calls": len(action.tool_calls),
                    "parse_errors": len(action.parse_errors),
                    "statuses": dict(result.observation.get("tool_statuses", {})),
                    "reward": result.reward,
                    "intermediate_reward": intermediate[-1],
                    "done": result.done,
                    "constraint": constraint,
                    "trainable": trainable_calls[-1],
                }
            )
            if result.done:
                finish_reason = c.finish_reason
                final_reward = step_final
                stop_reason = episode_stop_reason(result.info.get("stop_reason"))
                break
            compacted = agent.compact()
            if compacted is not None:
                agent.messages = list(compacted)
                closed.append(seg)
                seg = Segment(start_turn=turn + 1, reason="compaction")
                seg.add_context(self.render_prompt(agent.messages, tools))
                session = uuid.uuid4().hex
                continue
            history = agent.messages[: len(agent.messages) - len(new_messages) - 1]
            glue = self.render_glue(history, new_messages, tools)
            if c.finish_reason == "stop" and out and glue and glue[0] == out[-1]:
                glue = glue[1:]  # the model emitted the end-of-turn token itself: keep its own
            if limit is not None and len(seg.tokens) + len(glue) >= limit:
                finish_reason = "length"
                break
            seg.add_context(glue)
        if finish_reason == "length" and final_reward is None:
            final_reward = await env.truncate("length")
            total += final_reward
            stop_reason = "length"
        closed.append(seg)
        samples = [
            RolloutSample(
                tokens=s.tokens,
                logprobs=s.logprobs,
                loss_mask=s.loss_mask,
                reward=total,
                token_weight_versions=s.token_weight_versions,
                finish_reason=finish_reason if s is seg else "stop",
                text=last_text if s is seg else "",
            )
            for s in closed
            if s.num_generated > 0
        ]
        status_counts: dict[str, int] = {}
        for t in turns:
            for status in t["statuses"].values():
                status_counts[status] = status_counts.get(status, 0) + 1
            if t["parse_errors"]:
                status_counts["unparsable"] = status_counts.get("unparsable", 0) + t["parse_errors"]
        compactions = sum(1 for s in closed if s.reason == "compaction")
        metadata = {
            "return": total,
            "tool_status_counts": status_counts,
            "final_reward": final_reward,
            "intermediate_rewards": intermediate,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "truncated": finish_reason == "length",
            "num_turns": len(turns),
            "num_calls": len(turns),
            "labels": {"NEW": min(1, len(turns)), "APPEND": max(0, len(turns) - 1 - compactions), "WIPE": compactions},
            "drift": 0,
            "wall_s": round(time.perf_counter() - t_start, 4),
            "turns": turns,
            "segments": [
                {"start_turn": s.start_turn, "reason": s.reason, "tokens": len(s.tokens), "generated": s.num_generated}
                for s in closed
            ],
            "messages": agent.messages,
        }
        return Episode(
            segments=samples,
            reward=total,
            finish_reason=finish_reason,
            metadata=metadata,
            prompts=prompts,
            stop_reason=stop_reason,
            calls=calls,
            final_reward=float(final_reward or 0.0),
            intermediate=intermediate,
            trainable_calls=trainable_calls,
        )


def episode_stop_reason(env_reason: Optional[str]) -> str:
    """The episode's stop reason from the environment's ``info["stop_reason"]``: ``max_steps`` and the
    other ``STOP_REASONS`` as given; ``answer`` (a call-free reply), ``finish`` or none -> ``finish``."""
    return env_reason if env_reason in STOP_REASONS else "finish"
