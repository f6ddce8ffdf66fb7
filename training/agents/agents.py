"""Agents: keep the conversation, turn model text into an ``Action``, environment feedback into messages.

Lifecycle (driven by ``training.agents.trajectory.TrajectoryEngine``), one agent per episode:

1. ``agent.messages`` is the conversation so far: the task's messages, then the messages the
   environment opens the episode with (``Environment.reset()``; an agent built with ``messages=None``
   has none of its own: the environment supplies them all, as the gym and verifiers adapters do);
2. per turn: the engine samples from ``agent.messages`` (token-in/token-out), then
   ``action = agent.act(text)`` records the assistant reply and parses it;
3. the environment answers with a ``StepResult``; ``agent.observe(result)`` returns the new
   messages it appended (tool results, reminders), which the engine renders as template glue;
4. before the next turn the engine calls ``agent.compact()``: ``None`` keeps the context,
   a list of messages replaces it (the token prefix breaks: a new segment starts).

Constrained calls: ``tool_choice`` (``"required"`` or a named function) and ``response_format`` (JSON) on
the agent make every call constrained (``constraint_fields(turn)`` says which fields a turn's call sends;
override it to constrain some turns only). The server masks the tokens the grammar forbids and returns
the masked distribution's logprobs; whether such a call trains is the engine's ``constrained_calls``
switch (``training/utils/constrained_calls.py``, the proxy's name and meaning).

Agents: ``ModelAgent`` (one turn, the reply is the answer), ``ToolAgent`` (parses tool calls,
appends each result as a ``role: tool`` message, malformed calls as an error message).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

from training.openai_api.tool_parsers import ToolCall, ToolParser, format_parse_error, get_tool_parser


@dataclass
class Action:
    """What the agent made of one reply."""

    text: str
    """The reply text (for a tool agent: without the tool-call blocks)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    """One message per malformed tool call."""


@dataclass
class StepResult:
    """The environment's answer to one action."""

    observation: dict[str, Any] = field(default_factory=dict)
    """For tools: ``{"tool_outputs": {call_id: text}, "tool_statuses": {call_id: status}, "parse_errors": [...]}``."""
    reward: float = 0.0
    """This step's reward (intermediate reward, plus the final reward on the last step)."""
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Facts for logs (``answer``, ``stop_reason``...)."""


@dataclass
class AgentStep:
    """Record of one turn, for the transcript."""

    turn: int
    response: str
    tool_calls: list[dict] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)
    reward: float = 0.0
    done: bool = False


class ConversationAgent:
    """Base agent: message history and a step record. Subclasses override ``parse``."""

    def __init__(
        self,
        messages: Optional[list[dict]],
        tools: Optional[list[dict]] = None,
        *,
        tool_choice: Any = None,
        response_format: Optional[dict] = None,
    ):
        if messages is not None and (not isinstance(messages, list) or not messages):
            raise ValueError("messages: must be a non-empty list of chat messages (None: env.reset() gives them)")
        self.messages: list[dict] = copy.deepcopy(messages) if messages is not None else []
        """The conversation so far; starts as ``messages`` (empty for None) and the environment's opening."""
        self.tools = tools
        """Tool schemas rendered into the prompt (None = no tools)."""
        self.tool_choice = tool_choice
        """Every call's ``tool_choice``: ``"required"`` or ``{"type": "function", "function": {"name": X}}`` force
        a call of one of ``tools`` (constrained decoding); None / ``"auto"`` leave the model free."""
        self.response_format = response_format
        """Every call's ``response_format`` (``{"type": "json_object"}``, ``json_schema``: constrained decoding)."""
        self.steps: list[AgentStep] = []

    def constraint_fields(self, turn: int) -> dict[str, Any]:
        """The request fields that constrain turn ``turn``'s output (``tool_choice`` forcing a call, a
        ``response_format``); ``{}`` for a free sample. Override to constrain some turns only."""
        out: dict[str, Any] = {}
        if self.tool_choice not in (None, "auto", "none"):
            out["tool_choice"] = self.tool_choice
        if self.response_format not in (None, {"type": "text"}):
            out["response_format"] = self.response_format
        return out

    def parse(self, text: str, turn: int) -> Action:
        """The action a reply stands for (base: plain text, no calls)."""
        return Action(text=text.strip())

    def act(self, text: str) -> Action:
        """Record the assistant reply (as written) and return its action."""
        turn = len(self.steps)
        self.messages.append({"role": "assistant", "content": text})
        action = self.parse(text, turn)
        self.steps.append(
            AgentStep(
                turn=turn,
                response=text,
                tool_calls=[{"id": c.id, "name": c.name, "arguments": c.arguments} for c in action.tool_calls],
                parse_errors=list(action.parse_errors),
            )
        )
        return action

    def observe(self, result: StepResult) -> list[dict]:
        """Record the environment's answer; return the messages appended for the next turn."""
        step = self.steps[-1]
        step.reward, step.done = result.reward, result.done
        step.statuses = dict(result.observation.get("tool_statuses", {}))
        if result.done:
            return []
        new = self.feedback_messages(result)
        self.messages.extend(new)
        return new

    def feedback_messages(self, result: StepResult) -> list[dict]:
        """Messages that carry ``result`` to the model (base: a user message with ``observation['text']``)."""
        text = result.observation.get("text")
        return [{"role": "user", "content": str(text)}] if text else []

    def compact(self) -> Optional[list[dict]]:
        """Hook before each next turn: return a new message list to rebuild the context, or None to keep it."""
        return None


class ModelAgent(ConversationAgent):
    """Single turn: the reply is the answer."""


class ToolAgent(ConversationAgent):
    """Parses tool calls with ``parser``; tool results come back as ``role: tool`` messages in call order."""

    def __init__(
        self,
        messages: Optional[list[dict]],
        tools: Optional[list[dict]] = None,
        parser: ToolParser | str = "hermes",
        *,
        tool_choice: Any = None,
        response_format: Optional[dict] = None,
    ):
        super().__init__(messages, tools, tool_choice=tool_choice, response_format=response_format)
        self.parser = get_tool_parser(parser) if isinstance(parser, str) else parser

    def parse(self, text: str, turn: int) -> Action:
        parsed = self.parser.parse(text, id_prefix=f"call_{turn}_")
        return Action(text=parsed.content, tool_calls=parsed.calls, parse_errors=parsed.errors)

    def feedback_messages(self, result: StepResult) -> list[dict]:
        obs = result.observation
        out = [
            {"role": "tool", "tool_call_id": cid, "content": text}
            for cid, text in (obs.get("tool_outputs") or {}).items()
        ]
        out += [{"role": "tool", "content": format_parse_error(e, self.parser)} for e in obs.get("parse_errors") or []]
        return out + super().feedback_messages(result)
