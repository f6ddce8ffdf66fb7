"""Tools an agent can call, and the manager that runs one turn's calls.

A ``Tool`` has a JSON schema (``name``, ``description``, ``parameters``) and implements either
a sync ``apply(**kwargs)`` (run in a worker thread) or an async ``apply_async(**kwargs)``.

``ToolManager.execute_all(calls)`` runs the calls of one turn concurrently. It never raises
for a tool's fault: every call yields a ``ToolResult`` whose ``status`` is one of

- ``ok``: the tool returned; ``output`` is its result as text;
- ``error``: the tool raised; ``output`` names the exception;
- ``timeout``: the tool ran past its deadline (``Tool.timeout_s`` or the manager's);
- ``unknown_tool``: no tool of that name is registered;
- ``bad_arguments``: the arguments do not match the schema (missing / unexpected / wrong type).

Sync tools run in threads of their own (``run_in_tool_thread``), never in asyncio's default pool,
which the rest of the process shares: one daemon thread per call, started at once, so a tool's
deadline counts from the start of the call (no queue wait), and at most ``MAX_TOOL_THREADS`` calls
of one tool run at a time (more is an ``error`` result naming the hung calls). The bound is per
tool (per function), so one tool whose calls all hang never refuses the calls of another. An async tool is cancelled at its
deadline; a sync tool's thread cannot be killed, so its result is discarded and the thread runs on
until it returns. Being a daemon, a hung one never keeps the process from exiting.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from training.openai_api.tool_parsers import ToolCall

OK, ERROR, TIMEOUT, UNKNOWN_TOOL, BAD_ARGUMENTS = "ok", "error", "timeout", "unknown_tool", "bad_arguments"
STATUSES = (OK, ERROR, TIMEOUT, UNKNOWN_TOOL, BAD_ARGUMENTS)
"""Every status a ``ToolResult`` can carry."""

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


@dataclass
class ToolResult:
    """What one call produced; ``output`` is what the model sees next turn."""

    call_id: str
    name: str
    status: str
    """One of ``STATUSES``."""
    output: str
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == OK


MAX_TOOL_THREADS = 64
"""Sync calls of one tool (one function) running at once in the process, hung ones included; more are refused."""
_tool_slots: dict[Any, threading.BoundedSemaphore] = {}
"""One semaphore per tool function (``run_in_tool_thread``'s ``fn``)."""
_tool_slots_lock = threading.Lock()


def _slots_of(fn: Callable[..., Any]) -> threading.BoundedSemaphore:
    with _tool_slots_lock:
        slots = _tool_slots.get(fn)
        if slots is None:
            slots = _tool_slots[fn] = threading.BoundedSemaphore(MAX_TOOL_THREADS)
        return slots


async def run_in_tool_thread(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Run a sync tool in a daemon thread of its own and await its result (see the module docstring)."""
    slots = _slots_of(fn)
    if not slots.acquire(blocking=False):
        name = getattr(fn, "__qualname__", None) or repr(fn)
        raise RuntimeError(f"{MAX_TOOL_THREADS} calls of {name} are still running (is it hung?); refusing another")
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def deliver(value: Any, error: Optional[BaseException]) -> None:
        if future.done():  # cancelled at its deadline
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def work() -> None:
        try:
            value, error = fn(**kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting call
            value, error = None, e
        finally:
            slots.release()
        try:
            loop.call_soon_threadsafe(deliver, value, error)
        except RuntimeError:  # the loop is gone: nobody waits for this result
            pass

    threading.Thread(target=work, name=f"tool-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future


class Tool:
    """Base class: set ``name``, ``description``, ``parameters`` and override ``apply`` or ``apply_async``."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    """JSON schema of the keyword arguments (an ``object`` schema)."""
    timeout_s: Optional[float] = None
    """This tool's deadline per call; None = the manager's default."""

    def apply(self, **kwargs: Any) -> Any:
        """Sync implementation (runs in a worker thread)."""
        raise NotImplementedError(f"tool {self.name!r} implements neither apply nor apply_async")

    async def apply_async(self, **kwargs: Any) -> Any:
        """Async implementation; the default runs ``apply`` in a worker thread."""
        return await run_in_tool_thread(self.apply, **kwargs)

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style schema that chat templates render (``tools=[...]``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check_arguments(self, arguments: Any) -> Optional[str]:
        """None if ``arguments`` fit ``parameters``; otherwise what is wrong (top-level keys and types only)."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        props = self.parameters.get("properties", {}) or {}
        missing = [k for k in self.parameters.get("required", []) or [] if k not in arguments]
        if missing:
            return f"missing required argument(s): {', '.join(missing)}"
        allow_extra = self.parameters.get("additionalProperties", not props)  # declared properties: closed
        extra = [k for k in arguments if k not in props]
        if extra and allow_extra is False:
            return f"unexpected argument(s): {', '.join(extra)}; expected: {', '.join(props) or 'none'}"
        for key, value in arguments.items():
            want = (props.get(key) or {}).get("type")
            if want is None or (value is None and (props.get(key) or {}).get("nullable")):
                continue
            names = [want] if isinstance(want, str) else list(want)
            types = tuple(t for n in names for t in _JSON_TYPES.get(n, (object,)))
            bad_bool = isinstance(value, bool) and "boolean" not in names
            if not isinstance(value, types) or bad_bool:
                return f"argument {key!r} must be of type {'/'.join(names)}, got {type(value).__name__}"
        return None


_PY_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    tuple: "array",
    dict: "object",
    type(None): "null",
}


def _type_schema(hint: Any) -> dict[str, Any]:
    """JSON schema of one type hint (basic types, lists, dicts, Optional / Union, Literal); {} when unknown."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _PY_TYPES:
        return {"type": _PY_TYPES[hint]}
    if origin is typing.Literal:
        kinds = sorted({_PY_TYPES.get(type(a), "string") for a in args})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        parts = [_type_schema(a) for a in args if a is not type(None)]
        out = parts[0] if len(parts) == 1 else {"anyOf": parts}
        return {**out, "nullable": True} if type(None) in args else out
    if origin in (list, tuple, set):
        return {"type": "array", **({"items": _type_schema(args[0])} if args else {})}
    if origin is dict:
        return {"type": "object"}
    return {}


def function_schema(fn: Callable[..., Any]) -> tuple[str, dict[str, Any]]:
    """(description, parameters) of ``fn`` from its signature and Google-style docstring.

    transformers' ``get_json_schema`` when it accepts the function (every argument typed and
    described under ``Args:``); otherwise the same read done leniently: types from the hints
    (an untyped argument accepts anything), descriptions where the docstring has them,
    ``required`` = the arguments without a default. ``**kwargs`` leaves the object open
    (``additionalProperties: true``).
    """
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import parse_google_format_docstring

    open_kwargs = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    try:
        schema = get_json_schema(fn)["function"]
        parameters = dict(schema["parameters"], **({"additionalProperties": True} if open_kwargs else {}))
        return schema.get("description", ""), parameters
    except Exception:  # noqa: BLE001 - missing docstring / argument docs / hints: read what is there
        pass
    summary, arg_docs, _ = parse_google_format_docstring(inspect.getdoc(fn) or "")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: treat as untyped
        hints = {}
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = _type_schema(hints[name]) if name in hints else {}
        if (arg_docs or {}).get(name):
            prop["description"] = arg_docs[name]
        properties[name] = prop
        if param.default is param.empty:
            required.append(name)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    if open_kwargs:
        parameters["additionalProperties"] = True
    return (summary or "").strip(), parameters


class FunctionTool(Tool):
    """A tool made from a plain function (sync or ``async def``).

    Its schema comes from the function (``function_schema``): the docstring's summary is the
    description, the signature's type hints and the docstring's ``Args:`` give each argument's
    type and description. ``description`` / ``parameters`` override them.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: Optional[str] = None,
        description: Optional[str] = None,
        parameters: Optional[dict] = None,
        timeout_s: Optional[float] = None,
    ):
        self.fn = fn
        self.name = name or fn.__name__
        doc_description, doc_parameters = function_schema(fn)
        self.description = description if description is not None else doc_description
        self.parameters = parameters or doc_parameters
        self.timeout_s = timeout_s

    def apply(self, **kwargs: Any) -> Any:
        return self.fn(**kwargs)

    async def apply_async(self, **kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**kwargs)
        return await run_in_tool_thread(self.fn, **kwargs)


def output_text(value: Any, max_chars: int) -> str:
    """A tool's return value as the text the model sees (JSON for non-strings), cut at ``max_chars``."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(value)
    if len(text) > max_chars:
        text = text[:max_chars] + f"... [truncated {len(text) - max_chars} chars]"
    return text


class ToolManager:
    """Registry of tools by name; runs calls with a deadline each and never lets a tool crash the episode."""

    def __init__(self, tools: Iterable[Tool] = (), *, timeout_s: float = 10.0, max_output_chars: int = 4000):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars: must be >= 1, got {max_output_chars}")
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.tools: dict[str, Tool] = {}
        for t in tools:
            self.register(t)

    def register(self, tool: Tool) -> None:
        """Add ``tool``; its name must be a non-empty string not registered yet."""
        if not isinstance(tool, Tool):
            raise TypeError(f"tool: expected a Tool, got {type(tool).__name__}")
        if not tool.name or not isinstance(tool.name, str):
            raise ValueError(f"tool.name: must be a non-empty string, got {tool.name!r}")
        if tool.name in self.tools:
            raise ValueError(f"tool.name: {tool.name!r} is already registered")
        self.tools[tool.name] = tool

    def schemas(self) -> list[dict[str, Any]]:
        """Schemas of every registered tool, in registration order."""
        return [t.schema() for t in self.tools.values()]

    async def execute(self, call: ToolCall) -> ToolResult:
        """Run one call under its deadline; every failure becomes a status and an error text."""
        t0 = time.perf_counter()

        def result(status: str, output: str) -> ToolResult:
            return ToolResult(call.id, call.name, status, output, time.perf_counter() - t0)

        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return result(UNKNOWN_TOOL, f"Error: unknown tool {call.name!r}. Available tools: {known}.")
        problem = tool.check_arguments(call.arguments)
        if problem is not None:
            return result(BAD_ARGUMENTS, f"Error: bad arguments for {call.name}: {problem}.")
        deadline = tool.timeout_s if tool.timeout_s is not None else self.timeout_s
        try:
            value = await asyncio.wait_for(tool.apply_async(**call.arguments), deadline)
        except asyncio.TimeoutError:
            return result(TIMEOUT, f"Error: {call.name} did not finish within {deadline:g} s.")
        except asyncio.CancelledError:
            raise
        except TypeError as e:  # a signature mismatch the schema did not catch
            return result(BAD_ARGUMENTS, f"Error: bad arguments for {call.name}: {e}.")
        except Exception as e:  # noqa: BLE001 - a tool's fault is an observation, never a crash
            return result(ERROR, f"Error: {call.name} failed: {type(e).__name__}: {e}")
        return result(OK, output_text(value, self.max_output_chars))

    async def execute_all(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Run the calls concurrently; results in the order of ``calls``."""
        return list(await asyncio.gather(*(self.execute(c) for c in calls)))
