"""Real agent frameworks pointed at the training proxy: run by ``tests/proxy/test_clients.py`` with ``.venv-clients``'s Python.

    .venv-clients/bin/python tests/client_agents.py FRAMEWORK --base-url URL --api-key KEY [--stream] [--api chat|responses]

Each framework runs on its own defaults (its default model class and API, its own tool and output
machinery) with one function tool, ``get_weather(city)``, and prints one line ``CLIENT_RESULT <json>``:
``{"framework", "output", "tool_results"}`` (``tool_results``: how many times the tool ran). The model is
the project's random tiny model, which never calls a tool on its own: where the framework lets an agent
force a call (``tool_choice``) the scenario does, and a structured ``output_type`` / ``response_format``
makes the final answer a short JSON object (constrained decoding), so every reply ends well within the
context. This file imports nothing from the project: it is an agent as a user would write it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Literal

from pydantic import BaseModel

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network: LiteLLM's bundled price table
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

TASK = "Is it warm in Oslo? Check the weather, then answer."
RESULT_PREFIX = "CLIENT_RESULT "
"""The result line starts with this (a framework may print to stdout too)."""
CALLS = {"n": 0}


class Answer(BaseModel):
    verdict: Literal["warm", "cold"]


def weather(city: str) -> str:
    CALLS["n"] += 1
    return f"12 degrees in {city}"


async def openai_agents(args) -> dict:
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0), False)

    @function_tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """Weather in a city."""
        return weather(city)

    agent = Agent(
        name="weather",
        instructions="Use the tool, then answer.",
        tools=[get_weather],
        output_type=Answer,
        model="gpt-test",  # the default model class: OpenAIResponsesModel (/v1/responses)
        model_settings=ModelSettings(tool_choice="required"),  # reset to auto after the call (its default)
    )
    if args.stream:
        result = Runner.run_streamed(agent, TASK)
        events = [e.type async for e in result.stream_events()]
        assert "raw_response_event" in events, events
    else:
        result = await Runner.run(agent, TASK)
    return result.final_output.model_dump()


async def langgraph(args) -> dict:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    @tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """Weather in a city."""
        return weather(city)

    llm = ChatOpenAI(
        model="gpt-test",
        base_url=args.base_url,
        api_key=args.api_key,
        max_retries=0,
        use_responses_api=args.api == "responses",
    )
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    structured = llm.with_structured_output(Answer)

    class State(MessagesState):
        answer: dict

    async def call_model(state):
        return {"messages": [await forced.ainvoke(state["messages"])]}

    async def answer(state):
        return {"answer": (await structured.ainvoke(state["messages"])).model_dump()}

    graph = StateGraph(State)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([get_weather]))
    graph.add_node("answer", answer)
    graph.add_edge(START, "model")
    graph.add_edge("model", "tools")
    graph.add_edge("tools", "answer")
    graph.add_edge("answer", END)
    app = graph.compile()
    inputs = {"messages": [("user", TASK)]}
    if args.stream:  # token by token from the model (LangGraph streams the chat model's chunks)
        chunks = [m async for m, _meta in app.astream(inputs, stream_mode="messages")]
        assert chunks, "no streamed message chunk"
        state = await app.ainvoke(inputs)  # the state of a run (the streamed one is not returned by astream)
    else:
        state = await app.ainvoke(inputs)
    return state["answer"]


async def pydantic_ai(args) -> dict:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("gpt-test", provider=OpenAIProvider(base_url=args.base_url, api_key=args.api_key))
    agent = Agent(model, output_type=Answer, instructions="Use the tool, then answer.", retries=3)

    @agent.tool_plain
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """Weather in a city."""
        return weather(city)

    if args.stream:
        async with agent.run_stream(TASK) as run:
            return (await run.get_output()).model_dump()
    return (await agent.run(TASK)).output.model_dump()


async def smolagents(args) -> dict:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """Weather in a city.

        Args:
            city: The city.
        """
        return weather(city)

    model = OpenAIServerModel(model_id="gpt-test", api_base=args.base_url, api_key=args.api_key, max_tokens=64)
    agent = ToolCallingAgent(
        tools=[get_weather], model=model, max_steps=3, stream_outputs=args.stream, verbosity_level=0
    )
    out = await asyncio.to_thread(agent.run, TASK)
    return {"answer": str(out)[:200]}


async def litellm(args) -> dict:
    import litellm as llm

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"enum": ["Oslo", "Paris"]}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    common = {"model": "openai/gpt-test", "api_base": args.base_url, "api_key": args.api_key, "tools": tools}
    messages = [{"role": "user", "content": TASK}]
    first = await llm.acompletion(
        messages=messages, tool_choice={"type": "function", "function": {"name": "get_weather"}}, **common
    )
    msg = first.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        city = json.loads(call.function.arguments)["city"]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": weather(city)})
    if args.stream:
        stream = await llm.acompletion(messages=messages, max_tokens=8, stream=True, **common)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    else:
        text = (await llm.acompletion(messages=messages, max_tokens=8, **common)).choices[0].message.content
    return {"answer": text}


FRAMEWORKS = {f.__name__: f for f in (openai_agents, langgraph, pydantic_ai, smolagents, litellm)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=sorted(FRAMEWORKS))
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--api", choices=("chat", "responses"), default="chat")
    args = parser.parse_args()
    output = asyncio.run(FRAMEWORKS[args.framework](args))
    print(
        "\n" + RESULT_PREFIX + json.dumps({"framework": args.framework, "output": output, "tool_results": CALLS["n"]})
    )


if __name__ == "__main__":
    main()
