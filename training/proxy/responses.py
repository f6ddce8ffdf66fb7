"""``POST /v1/responses`` through the proxy: the OpenAI Responses API, recorded exactly like a chat call.

An agent on the Responses API (openai-agents' default ``OpenAIResponsesModel``, ``client.responses.create``,
LangChain's Responses mode) points its ``base_url`` at the proxy as any other agent does. Its request is
translated into the chat request it means (``training/openai_api/responses_request.py``), which then takes the
proxy's chat path unchanged (``ProxyServer.body_and_session``, then the ``CallForwarder`` of ``forwarding.py``):
the sampling-field policy (``sampling_policy.py``; a forced ``tool_choice`` or a ``text.format`` other than text
is a constrained call, flagged), the upstream call with token ids and logprobs on, the ``CallRecord`` (prompt ids, output ids, logprobs, weight versions, the messages it stands
for) and its NEW / APPEND / WIPE label. The chat reply is translated back into a Responses object
(``training/openai_api/responses_output.py``): the agent gets the RL extras only when it asks
(``return_token_ids``, ``include: ["message.output_text.logprobs"]``).

The upstream is asked for chat completions, never for ``/v1/responses``: any OpenAI-compatible server with
token ids on chat works behind it, and the conversation is the proxy's to keep. ``previous_response_id``:
each stored response (``store`` unless false) keeps its conversation in its session's ``ResponseStore``
(``SessionRecord.responses``: the last ``SESSION_RESPONSES`` responses, within ``SESSION_RESPONSE_CHARS``),
so an id continues its conversation within its own session; another session's id, or an unknown one, is a
404 naming ``previous_response_id``.

``stream: true`` is served like a chat stream (``upstream_stream``): relayed (the upstream's chat chunks
become Responses events as they arrive, ``training/openai_api/responses_stream.py``, and are accumulated into the
record) or synthesised from the full reply; either way the record is the upstream's tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Optional

import aiohttp
from aiohttp import web

from training.proxy import sampling_policy
from training.proxy.forwarding import label_headers
from training.proxy.records import SessionRecord
from training.proxy.streaming import ClientStalled, StreamAccumulator, chat_chunks
from training.proxy.upstream import UpstreamError
from training.utils.http import SESSION_HEADER
from training.openai_api.errors import error_response
from training.openai_api.responses_output import completed_response, conversation_after, new_response_id
from training.openai_api.responses_request import (
    CHAT_TO_RESPONSES_FIELDS,
    ResponsesRequest,
    ResponsesRequestError,
    parse_responses_request,
)
from training.openai_api.responses_stream import ResponsesEventStream
from training.openai_api.sse import iter_sse, open_sse, sse_event

ProxyServer = Any
"""``training.proxy.server.ProxyServer`` (not imported: it imports this module)."""


async def serve(proxy: ProxyServer, request: web.Request) -> web.StreamResponse:
    """Answer one ``/v1/responses`` call of a session (module docstring)."""
    body, session, err = await proxy.body_and_session(request)
    if err is not None:
        return err
    try:
        rr = parse_responses_request(body)
    except ResponsesRequestError as e:
        return error_response(e.status, str(e), param=e.param)
    history: list[dict] = []
    if rr.previous_response_id is not None:
        found = session.responses.get(rr.previous_response_id)
        if found is None:
            message = session.responses.missing_message(rr.previous_response_id, "in this session")
            return error_response(404, message, "invalid_request_error", "previous_response_id")
        history = found
    chat = rr.chat_body(history)
    refused = sampling_policy.refusal(chat)
    if refused is not None:
        return error_response(400, refused[1], param=refused[0])
    proxy.forwarder.stamp_seed(session, chat)
    with proxy.table.active(session):  # a session with a call in flight is never evicted
        async with proxy.admitted(request, session):
            if rr.stream:
                try:
                    return await _stream(proxy, request, session, rr, chat, history)
                except ClientStalled as e:  # the agent stopped reading: aborted, recorded (server.py, ``write``)
                    return e.resp
            out = await proxy.forwarder.exchange(request, session, "chat", chat)
    if isinstance(out, web.Response):
        return _renamed(out)
    reply, record = out
    response = completed_response(rr, reply, new_response_id(), int(time.time()), _model(rr, reply))
    _keep(session, rr, history, response)
    return web.json_response(response, headers=label_headers(record))


def _model(rr: ResponsesRequest, reply: dict) -> str:
    return rr.model if rr.model is not None else str(reply.get("model", ""))


def _keep(session: SessionRecord, rr: ResponsesRequest, history: list[dict], response: dict) -> None:
    if rr.store:
        session.responses.put(response["id"], conversation_after(rr, history, response))


def _renamed(resp: web.Response) -> web.Response:
    """An upstream error about a chat field, naming the Responses field the agent sent instead."""
    try:
        body = json.loads(resp.body) if resp.body else {}
    except (TypeError, ValueError):
        return resp
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return resp
    message, param = str(err.get("message", "")), err.get("param")
    for chat, responses in CHAT_TO_RESPONSES_FIELDS.items():
        message = message.replace(f"'{chat}'", f"'{responses}'")
    param = CHAT_TO_RESPONSES_FIELDS.get(param, param) if isinstance(param, str) else param
    return error_response(resp.status, message, err.get("type") or "invalid_request_error", param)


async def _write(
    proxy: ProxyServer, request: web.Request, session: SessionRecord, resp: web.StreamResponse, events: list[dict]
) -> None:
    """The events, each within the proxy's ``stream_write_timeout_s`` (``ClientStalled`` when the agent stalls)."""
    for event in events:
        await proxy.write(request, session, resp, sse_event(event, event["type"]))


async def _stream(
    proxy: ProxyServer,
    request: web.Request,
    session: SessionRecord,
    rr: ResponsesRequest,
    chat: dict,
    history: list[dict],
) -> web.StreamResponse:
    url = proxy.pool.pick(session.session_id)
    if proxy.forwarder.relays(url):
        resp = await _relay(proxy, request, session, rr, chat, history, url)
        if resp is not None:
            return resp
    out = await proxy.forwarder.exchange(request, session, "chat", chat)
    if isinstance(out, web.Response):
        return _renamed(out)
    reply, _ = out
    events = ResponsesEventStream(rr, new_response_id(), int(time.time()), _model(rr, reply))
    resp = await open_sse(request)
    await _write(proxy, request, session, resp, events.opening())
    for chunk in chat_chunks(reply, include_usage=False):
        await _write(proxy, request, session, resp, events.chat_chunk(chunk))
    final = events.closing(reply)
    await _write(proxy, request, session, resp, final)
    _keep(session, rr, history, final[-1]["response"])
    await resp.write_eof()
    return resp


async def _relay(
    proxy: ProxyServer,
    request: web.Request,
    session: SessionRecord,
    rr: ResponsesRequest,
    chat: dict,
    history: list[dict],
    url: str,
) -> Optional[web.StreamResponse]:
    """The upstream's chat stream as Responses events, chunk by chunk, accumulated into the record.

    None when the upstream refuses ``stream`` (a 400 naming it, ``upstream_stream="auto"``): the caller
    synthesises the stream, for this call and every later one to that upstream."""
    fwd = proxy.forwarder.upstream_body(chat, "chat")
    fwd.update(stream=True, stream_options={"include_usage": True})
    acc = StreamAccumulator("chat")
    events: Optional[ResponsesEventStream] = None
    resp: Optional[web.StreamResponse] = None
    try:
        async with proxy.pool.stream(
            url, "/v1/chat/completions", fwd, headers={SESSION_HEADER: session.session_id}
        ) as up:
            if up.status != 200:
                parsed: Any = await up.json(content_type=None)
                param = (parsed.get("error") or {}).get("param") if isinstance(parsed, dict) else None
                if proxy.forwarder.stream_refused(url, up.status, param):
                    return None
                return _renamed(web.json_response(parsed, status=up.status))
            resp = await open_sse(request)
            async for chunk in iter_sse(up.content):
                acc.add(chunk)
                if events is None:
                    events = ResponsesEventStream(rr, new_response_id(), int(time.time()), _model(rr, chunk))
                    await _write(proxy, request, session, resp, events.opening())
                await _write(proxy, request, session, resp, events.chat_chunk(chunk))
    except UpstreamError as e:
        session.upstream_failed(str(e), deployment=True, lost=e.lost)
        return error_response(502, f"upstream failed: {e}", "upstream_error")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # broke mid-stream
        broke = f"upstream stream broke: {type(e).__name__}: {e}"
        session.upstream_failed(broke, deployment=not isinstance(e, ValueError))  # a cut stream, or a bad chunk
        if resp is None:
            return error_response(502, session.upstream_errors[-1], "upstream_error")
        return await _fail(proxy, request, session, resp, events, rr, session.upstream_errors[-1])
    reply = acc.reply()
    if events is None:  # an upstream stream without a single chunk
        events = ResponsesEventStream(rr, new_response_id(), int(time.time()), _model(rr, reply))
        await _write(proxy, request, session, resp, events.opening())
    record = await proxy.forwarder.commit(session, reply, "chat", chat, request, url)
    if record is None:
        return await _fail(proxy, request, session, resp, events, rr, session.upstream_errors[-1])
    final = events.closing(reply)
    await _write(proxy, request, session, resp, final)
    _keep(session, rr, history, final[-1]["response"])
    await resp.write_eof()
    return resp


async def _fail(
    proxy: ProxyServer,
    request: web.Request,
    session: SessionRecord,
    resp: web.StreamResponse,
    events: Optional[ResponsesEventStream],
    rr: ResponsesRequest,
    message: str,
) -> web.StreamResponse:
    """End a started stream with ``response.failed`` (the session already noted the upstream error)."""
    if events is None:
        events = ResponsesEventStream(rr, new_response_id(), int(time.time()), rr.model or "")
        await _write(proxy, request, session, resp, events.opening())
    await _write(proxy, request, session, resp, events.failed(message))
    await resp.write_eof()
    return resp
