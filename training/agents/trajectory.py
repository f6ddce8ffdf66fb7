"""Trajectory collect engine: one agent-environment episode through the sampler, token-in/token-out.

Steps (``EpisodeRun``): ``open`` (``env.reset()``: its messages join the agent's; the first prompt),
``turn`` until one ends the episode (sample, ``agent.act``, ``env.step``, record; then compaction or
glue), ``close`` (an over-length episode scored by ``env.truncate``; the segments and ``EpisodeFacts``).

Prompt construction (never re-tokenizes what the model generated):

- turn 0: ``prompt_0 = chat_template(messages, tools=schemas, add_generation_prompt=True)``;
- turn k+1: ``prompt_{k+1} = prompt_k + output_k + glue_k``, where ``output_k`` are the server's
  generated ids and ``glue_k`` is the template text rendered *after* a stub assistant reply:
  ``render(history + [assistant: STUB] + new_messages)[after STUB]``, tokenized on its own.
  When the model stopped on a token that equals the glue's first token (the end-of-turn
  token it emitted itself), that glue token is dropped: the model's token is kept.

So every prompt sent is a prefix of the final ``tokens``; ``loss_mask`` is 1 exactly on the
generated ids (with the sampler's logprobs) and 0 on the first prompt, tool results and glue. The
segments are built by the one sample builder (``training/utils/rl/rollout/sample_builder.py``, the
proxy's too): its mask, logprob and weight-version conventions, so the proxy gives the same samples
for the same calls.

Segments: when ``agent.compact()`` returns new messages, the context is rebuilt from them and
the token prefix breaks; the episode then has several segments (a ``RolloutRun``). The last
segment's ``finish_reason`` is the episode's; an earlier one's is its last call's.

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
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

from training.agents.agents import Action, ConversationAgent, StepResult
from training.agents.environments import Environment
from training.utils.constrained_calls import checked_constrained_calls, constraint_of, trains
from training.openai_api.tool_parsers import messages_with_tools, render_prompt_ids
from training.utils.rl.credit import TRANSITIONS, CreditFn, credit_parts, transitions_of
from training.utils.rl.rollout import STOP_REASONS, RolloutRun, RolloutSample
from training.utils.rl.rollout.episode_facts import EpisodeFacts
from training.utils.rl.rollout.sample_builder import CallTokens, SampleBuilder, call_weight_versions

MODES = ("stitch", TRANSITIONS)
"""How an episode becomes training data (``Episode.to_result``): segments, or one sample per call."""

STUB = "<<assistant-reply-stub-5c1e>>"
"""Placeholder assistant content used to locate the template glue in a rendering."""


class TemplateGlueError(ValueError):
    """The chat template did not render the stub assistant reply, so the glue cannot be located."""


@dataclass
class Episode:
    """A finished episode: its segments, return and facts."""

    segments: list[RolloutSample]
    """Segments with at least one generated token, in order."""
    reward: float
    """The return: the sum of step rewards (final reward + intermediate rewards)."""
    finish_reason: str
    """The sampler's finish reason of the last call (``length`` when the episode was cut)."""
    facts: EpisodeFacts = field(default_factory=EpisodeFacts)
    """What the run's ``metadata`` says: the transcript (``turns``, ``segments``, ``messages``), ``return``,
    ``final_reward``, ``stop_reason``, ``intermediate_rewards`` and the step metrics' keys."""
    prompts: list[list[int]] = field(default_factory=list)
    """Every prompt sent to the sampler, in order (for checks; not logged)."""
    calls: list[CallTokens] = field(default_factory=list)
    """Every model call's exact prompt and output ids, in order (for ``transitions``); ``trainable`` False
    for a constrained call under ``constrained_calls="exclude"``."""

    @property
    def metadata(self) -> dict[str, Any]:
        """``facts`` as the JSON-able dict a run carries (``EpisodeFacts.to_metadata``)."""
        return self.facts.to_metadata()

    @property
    def stop_reason(self) -> str:
        """Why the episode ended: ``finish``, ``max_steps`` or ``length`` (``STOP_REASONS``)."""
        return self.facts.stop_reason or "finish"

    @property
    def final_reward(self) -> float:
        """R: the environment's score of the answer (the return without intermediate rewards)."""
        return float(self.facts.final_reward or 0.0)

    @property
    def intermediate(self) -> list[float]:
        """Per call, its intermediate reward (tool status); ``reward == final_reward + sum(intermediate)``."""
        return list(self.facts.intermediate_rewards or [])

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
        metadata = replace(self.facts, mode="stitch").to_metadata()
        return RolloutRun(segments=list(self.segments), reward=self.reward, metadata=metadata)

    def transitions(
        self, credit_fn: Optional[CreditFn] = None, *, max_seq_len: Optional[int] = None
    ) -> Optional[RolloutRun]:
        """One sample per model call: reward g_k·R + i_k (R = ``final_reward``; i_k = the credit's own
        plus the call's intermediate reward), weight ``1 / n``; None when no call generated a token."""
        turns = self.facts.turns or []
        shares, intermediate = credit_parts(credit_fn, turns, self.final_reward, extra=self.intermediate)
        keep = [k for k, c in enumerate(self.calls) if c.trainable]
        res = transitions_of(  # credit over every call; an excluded constrained call gives no sample
            [self.calls[k] for k in keep],
            [shares[k] for k in keep],
            [intermediate[k] for k in keep],
            self.final_reward,
            max_seq_len=max_seq_len,
        )
        return res.to_run(self.final_reward, self.facts)


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

    def max_new_tokens(self) -> Optional[int]:
        """A turn's ``max_tokens`` before the length limit clips it (the engine's sampling, else the sampler's)."""
        if "max_tokens" in self.sampling:
            return self.sampling["max_tokens"]
        return (getattr(self.sampler, "sampling_defaults", None) or {}).get("max_tokens")

    # ---- episode ---------------------------------------------------------------------------
    async def collect(self, agent: ConversationAgent, env: Environment) -> Episode:
        """Run the episode to its end (or to the length limit) and return it: open, then turns until
        one ends the episode, then close (``EpisodeRun``)."""
        run = EpisodeRun(self, agent, env)
        await run.open()
        while await run.turn():
            pass
        return await run.close()


class EpisodeRun:
    """One episode in progress, in named steps: ``open`` (the environment's ``reset``, the first prompt),
    ``turn`` (sample, act, step the environment, record; then compaction or glue), ``close`` (score a cut
    episode, build the segments and the facts)."""

    def __init__(self, engine: TrajectoryEngine, agent: ConversationAgent, env: Environment):
        self.engine, self.agent, self.env = engine, agent, env
        self.limit = engine.max_total_tokens
        """The length limit: no prompt + output passes it (None = unlimited)."""
        self.tools: Optional[list[dict]] = None
        self.segment = SampleBuilder()
        """The segment under construction; its tokens are the next prompt."""
        self.closed: list[SampleBuilder] = []
        """Segments ended by a compaction."""
        self.session = uuid.uuid4().hex
        """The sampler's session id (KV reuse); a new one after each compaction."""
        self.prompts: list[list[int]] = []
        self.calls: list[CallTokens] = []
        self.turns: list[dict] = []
        self.intermediate: list[float] = []
        self.total = 0.0
        """The return so far: the sum of step rewards."""
        self.final_reward: Optional[float] = None
        self.finish_reason = "stop"
        self.stop_reason = "finish"
        self.last_text = ""
        self.t_start = time.perf_counter()

    async def open(self) -> None:
        """Reset the environment (its opening messages join the agent's) and render the first prompt."""
        self.agent.messages.extend(await self.env.reset())
        if not self.agent.messages:
            raise ValueError("messages: the episode has no message (the agent's and env.reset()'s are both empty)")
        if self.agent.tools is None:
            self.agent.tools = self.env.tool_schemas()
        self.tools = self.agent.tools
        self.segment.add_context(self.engine.render_prompt(self.agent.messages, self.tools))

    def room(self) -> Optional[int]:
        """Tokens the next output may take before the length limit (None = unlimited)."""
        return None if self.limit is None else self.limit - len(self.segment.tokens)

    def sampling(self, constraint: Optional[dict], room: Optional[int]) -> dict:
        """The call's sampling fields: the engine's, ``max_tokens`` clipped to ``room``, the constraint's."""
        sampling = dict(self.engine.sampling)
        if room is not None:
            want = self.engine.max_new_tokens()
            sampling["max_tokens"] = room if want is None else min(want, room)
        if constraint is not None:  # a forced call's grammar needs the tool schemas (not rendered again)
            sampling.update(constraint, **({"tools": self.tools} if "tool_choice" in constraint else {}))
        return sampling

    async def sample(self, turn: int, room: Optional[int]) -> tuple[Any, CallTokens, Optional[dict], float]:
        """One model call on the segment's tokens, added to the segment: (completion, call, constraint, seconds)."""
        constraint = constraint_of(self.agent.constraint_fields(turn))
        trainable = trains(constraint, self.engine.constrained_calls)
        prompt = list(self.segment.tokens)
        t0 = time.perf_counter()
        (c,) = await self.engine.sampler.sample_with_prompt_tokens(
            prompt, n=1, session_id=self.session, **self.sampling(constraint, room)
        )
        sample_s = time.perf_counter() - t0
        if c.prompt_tokens != prompt:
            raise RuntimeError("the server's prompt_token_ids differ from the prompt sent (token drift)")
        out = c.output_tokens
        call = CallTokens(
            prompt,
            list(out),
            list(c.inference_logprobs),
            call_weight_versions(c.token_weight_versions, c.weight_version, len(out)),
            c.finish_reason,
            turn,
            trainable,  # constrained_calls="exclude": a constrained output is context, never trained on
        )
        self.prompts.append(prompt)
        self.calls.append(call)
        self.segment.add_call(call)
        return c, call, constraint, sample_s

    async def turn(self) -> bool:
        """One turn: sample, act, step the environment, record it, then continue the context (compaction
        or glue). False when the episode is over."""
        turn = len(self.turns)
        room = self.room()
        if room is not None and room < 1:
            self.finish_reason = "length"
            return False
        c, call, constraint, sample_s = await self.sample(turn, room)
        self.last_text = self.engine.tokenizer.decode(call.output_ids, skip_special_tokens=True)
        action = self.agent.act(self.last_text)
        t1 = time.perf_counter()
        result = await self.env.step(action)
        env_s = time.perf_counter() - t1
        self.total += result.reward
        step_final = result.info.get("final_reward", result.reward) if result.done else 0.0
        self.intermediate.append(result.reward - step_final)
        new_messages = self.agent.observe(result)
        self.record(c, call, constraint, action, result, sample_s, env_s)
        if result.done:
            self.finish_reason = c.finish_reason
            self.final_reward = step_final
            self.stop_reason = episode_stop_reason(result.info.get("stop_reason"))
            return False
        return self.continue_context(turn, call, new_messages)

    def record(
        self,
        c: Any,
        call: CallTokens,
        constraint: Optional[dict],
        action: Action,
        result: StepResult,
        sample_s: float,
        env_s: float,
    ) -> None:
        """The turn's entry in the transcript (``metadata["turns"]``)."""
        self.turns.append(
            {
                "turn": call.index,
                "prompt_tokens": c.prompt_len,
                "output_tokens": len(call.output_ids),
                "finish_reason": c.finish_reason,
                "weight_version": c.weight_version,
                "cached_tokens": c.cached_tokens,
                "sample_s": round(sample_s, 4),
                "env_s": round(env_s, 4),
                "tool_calls": len(action.tool_calls),
                "parse_errors": len(action.parse_errors),
                "statuses": dict(result.observation.get("tool_statuses", {})),
                "reward": result.reward,
                "intermediate_reward": self.intermediate[-1],
                "done": result.done,
                "constraint": constraint,
                "trainable": call.trainable,
            }
        )

    def continue_context(self, turn: int, call: CallTokens, new_messages: list[dict]) -> bool:
        """Before the next turn: a compaction opens a new segment from the agent's new messages; otherwise the
        glue of the new messages joins the segment. False when the glue would not fit (over-length)."""
        compacted = self.agent.compact()
        if compacted is not None:
            self.agent.messages = list(compacted)
            self.closed.append(self.segment)
            self.segment = SampleBuilder(start_call=turn + 1, reason="compaction")
            self.segment.add_context(self.engine.render_prompt(self.agent.messages, self.tools))
            self.session = uuid.uuid4().hex
            return True
        history = self.agent.messages[: len(self.agent.messages) - len(new_messages) - 1]
        glue = self.engine.render_glue(history, new_messages, self.tools)
        out = call.output_ids
        if call.finish_reason == "stop" and out and glue and glue[0] == out[-1]:
            glue = glue[1:]  # the model emitted the end-of-turn token itself: keep its own
        if self.limit is not None and len(self.segment.tokens) + len(glue) >= self.limit:
            self.finish_reason = "length"
            return False
        self.segment.add_context(glue)
        return True

    async def close(self) -> Episode:
        """Score an episode cut for length (``env.truncate``), then its segments and facts."""
        if self.finish_reason == "length" and self.final_reward is None:
            self.final_reward = await self.env.truncate("length")
            self.total += self.final_reward
            self.stop_reason = "length"
        builders = self.closed + [self.segment]
        samples = []
        for b in builders:  # the last segment ends as the episode did; an earlier one as its last call
            last = b is self.segment
            finish = self.finish_reason if last else None
            sample = b.to_sample(self.total, finish_reason=finish, text=self.last_text if last else "")
            if sample is not None:
                samples.append(sample)
        return Episode(
            segments=samples,
            reward=self.total,
            finish_reason=self.finish_reason,
            facts=self.facts(builders),
            prompts=self.prompts,
            calls=self.calls,
        )

    def facts(self, builders: list[SampleBuilder]) -> EpisodeFacts:
        """The episode's ``EpisodeFacts``: the step metrics' keys and the transcript."""
        status_counts: dict[str, int] = {}
        for t in self.turns:
            for status in t["statuses"].values():
                status_counts[status] = status_counts.get(status, 0) + 1
            if t["parse_errors"]:
                status_counts["unparsable"] = status_counts.get("unparsable", 0) + t["parse_errors"]
        n = len(self.turns)
        compactions = sum(1 for b in builders if b.reason == "compaction")
        return EpisodeFacts(
            stop_reason=self.stop_reason,
            episode_return=self.total,
            num_calls=n,
            labels={"NEW": min(1, n), "APPEND": max(0, n - 1 - compactions), "WIPE": compactions},
            drift=0,
            tool_status_counts=status_counts,
            truncated=self.finish_reason == "length",
            final_reward=self.final_reward,
            finish_reason=self.finish_reason,
            num_turns=n,
            wall_s=round(time.perf_counter() - self.t_start, 4),
            turns=self.turns,
            segments=[
                {"start_turn": b.start_call, "reason": b.reason, "tokens": len(b.tokens), "generated": b.num_generated}
                for b in builders
            ],
            messages=self.agent.messages,
            intermediate_rewards=self.intermediate,
            reward_components=self.env.reward_components(),
        )


def episode_stop_reason(env_reason: Optional[str]) -> str:
    """The episode's stop reason from the environment's ``info["stop_reason"]``: ``max_steps`` and the
    other ``STOP_REASONS`` as given; ``answer`` (a call-free reply), ``finish`` or none -> ``finish``."""
    return env_reason if env_reason in STOP_REASONS else "finish"
