"""Real agent frameworks, on their defaults, through the proxy in front of the embedded server (``pytest -m clients``).

Needs ``.venv-clients`` (``bash scripts/setup_clients.sh``: openai-agents, langchain-openai + langgraph,
pydantic-ai, smolagents and litellm from PyPI); skipped without it. Each framework runs as a separate
process in that venv (``tests/client_agents.py``: an agent as a user writes it, importing nothing from this
project), pointed at a proxy session URL with the session's key; the proxy and the server run here, on the
tiny model. Between the proxy and the server sits a tap that relays every call unchanged and keeps what the
server returned, so the check is literal: every recorded call's prompt ids, output ids and logprobs are the
server's, in order, streamed or not (the tap is a plain relay of real traffic, not a stand-in).
"""

import asyncio
import json
import os
import subprocess
import threading
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from training.deployment.engine.constraints import missing_library
from training.proxy import ProxyServer

ROOT = Path(__file__).resolve().parents[2]
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"
AGENTS = ROOT / "tests" / "client_agents.py"
RESULT_PREFIX = "CLIENT_RESULT "

pytestmark = [
    pytest.mark.clients,
    pytest.mark.skipif(
        not CLIENTS_PYTHON.exists(), reason=f"no clients venv at {CLIENTS_PYTHON}: run bash scripts/setup_clients.sh"
    ),
    pytest.mark.skipif(missing_library() is not None, reason="needs llguidance (training[constrained])"),
]


class Tap:
    """Relays the proxy's upstream calls to the server unchanged (streams too) and keeps the server's replies."""

    def __init__(self, server_url: str):
        self.server_url = server_url
        self.replies: list[dict] = []
        """Per generation call that succeeded, in order: ``prompt_token_ids``, ``token_ids``, ``logprobs``."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("content-type", "authorization") or k.lower().startswith("x-")
        }
        async with aiohttp.ClientSession() as s:
            async with s.request(request.method, self.server_url + request.path_qs, data=body, headers=headers) as up:
                if not up.headers.get("Content-Type", "").startswith("text/event-stream"):
                    data = await up.read()
                    if up.status == 200 and request.path.endswith("/completions"):
                        self._keep_whole(json.loads(data))
                    return web.Response(body=data, status=up.status, content_type=up.content_type)
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                chunks = []
                async for line in up.content:
                    await resp.write(line)
                    text = line.decode().strip()
                    if text.startswith("data:") and text[5:].strip() != "[DONE]":
                        chunks.append(json.loads(text[5:]))
                self._keep_stream(chunks)
                await resp.write_eof()
                return resp

    def _keep_whole(self, reply: dict) -> None:
        choice = reply["choices"][0]
        self.replies.append(
            {
                "prompt_token_ids": choice.get("prompt_token_ids") or reply.get("prompt_token_ids"),
                "token_ids": choice["token_ids"],
                "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]],
            }
        )

    def _keep_stream(self, chunks: list[dict]) -> None:
        out = {"prompt_token_ids": None, "token_ids": [], "logprobs": []}
        for chunk in chunks:
            for choice in chunk.get("choices") or []:
                out["prompt_token_ids"] = out["prompt_token_ids"] or choice.get("prompt_token_ids")
                out["token_ids"] += choice.get("token_ids") or []
                out["logprobs"] += [e["logprob"] for e in ((choice.get("logprobs") or {}).get("content") or [])]
        self.replies.append(out)


class ProxyInThread:
    """The tap and the proxy on an event loop of their own (the agent runs as a blocking subprocess here)."""

    def __init__(self, server_url: str, **proxy_kwargs):
        self.tap = Tap(server_url)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy_kwargs = proxy_kwargs

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    async def _start(self):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.tap.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.proxy = ProxyServer([f"http://127.0.0.1:{port}"], **self.proxy_kwargs)
        await self.proxy.start()

    async def _stop(self):
        await self.proxy.stop()
        await self.runner.cleanup()

    def __enter__(self):
        self.run(self._start())
        return self

    def __exit__(self, *exc):
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_batch_size=8, max_model_len=4096)


def run_agent(server, framework: str, *args: str, **proxy_kwargs):
    """Run one framework's agent against a fresh proxy session; (its JSON line, the session, the tap's replies)."""
    with ProxyInThread(server.base_url, **proxy_kwargs) as p:
        sid = f"{framework}-{'-'.join(a.strip('-') for a in args) or 'plain'}"
        p.proxy.open_session(sid)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
        out = subprocess.run(
            [
                str(CLIENTS_PYTHON),
                str(AGENTS),
                framework,
                "--base-url",
                p.proxy.session_url(sid),
                "--api-key",
                p.proxy.session_key(sid),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**env, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"},
        )
        session = p.proxy.close_session(sid)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(lines[0][len(RESULT_PREFIX) :])
    return result, session, p.tap.replies


def assert_recorded_exactly(session, replies):
    """Every recorded call is the server's reply, in order, token for token."""
    assert session.calls and len(session.calls) == len(replies), (len(session.calls), len(replies))
    for call, truth in zip(session.calls, replies):
        assert call.prompt_ids == truth["prompt_token_ids"] and call.output_ids == truth["token_ids"]
        assert call.output_logprobs == pytest.approx(truth["logprobs"], abs=1e-6)
    labels = [c.label.kind for c in session.calls]
    assert labels[0] == "NEW" and all(k in ("NEW", "APPEND", "WIPE") for k in labels)


def tool_round_trip(session, result: str = "12 degrees in") -> bool:
    """The tool's result reached the model: a later call's messages carry it (as a ``tool`` message, or as the
    observation text smolagents writes)."""
    return any(result in str(m.get("content")) for c in session.calls for m in c.messages or [])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_agents_on_its_default_responses_model(server, stream):
    result, session, replies = run_agent(server, "openai_agents", *(["--stream"] if stream else []))
    assert result["output"]["verdict"] in ("warm", "cold") and result["tool_results"] == 1
    assert_recorded_exactly(session, replies)
    assert tool_round_trip(session) and len(session.calls) == 2
    forced, final = session.calls
    assert forced.constraint["tool_choice"] == "required" and forced.response_message["tool_calls"]
    assert final.label.kind == "APPEND" and "response_format" in final.constraint  # output_type: a JSON answer


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_langchain_with_langgraph(server, api, stream):
    result, session, replies = run_agent(server, "langgraph", "--api", api, *(["--stream"] if stream else []))
    assert result["output"]["verdict"] in ("warm", "cold") and result["tool_results"] >= 1
    assert_recorded_exactly(session, replies)
    assert tool_round_trip(session)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_pydantic_ai_with_its_default_tool_output(server, stream):
    result, session, replies = run_agent(server, "pydantic_ai", *(["--stream"] if stream else []))
    assert result["output"]["verdict"] in ("warm", "cold")
    assert_recorded_exactly(session, replies)
    assert all(c.constraint == {"tool_choice": "required"} for c in session.calls)  # output tools force a call
    if result["tool_results"]:  # the forced call chose get_weather (else final_result, at random): it went back
        assert tool_round_trip(session)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_smolagents_tool_calling_agent(server, stream):
    result, session, replies = run_agent(server, "smolagents", *(["--stream"] if stream else []))
    assert result["output"]["answer"]
    assert_recorded_exactly(session, replies)
    assert session.calls[0].constraint == {"tool_choice": "required"}  # ToolCallingAgent's default
    if result["tool_results"] and len(session.calls) > 1:  # the model chose get_weather over final_answer
        assert tool_round_trip(session)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_litellm_openai_route(server, stream):
    result, session, replies = run_agent(server, "litellm", *(["--stream"] if stream else []))
    assert result["tool_results"] == 1
    assert_recorded_exactly(session, replies)
    assert tool_round_trip(session) and session.calls[1].label.kind == "APPEND"
