"""Agents inside the rollout: tools, tool-call parsers, agents, environments, the trajectory
engine, the orchestrator, and ``make_agent_rollout_fn`` for the normal recipe (see README.md)."""

from training.agents.agents import Action, AgentStep, ConversationAgent, ModelAgent, StepResult, ToolAgent
from training.agents.environments import (
    FINISH_TOOL,
    Environment,
    FinishTool,
    IntermediateRewards,
    TaskEnvironment,
    ToolEnvironment,
)
from training.agents.orchestrator import Orchestrator, TrajectoryGroup
from training.agents.rollout_fn import engine_for_setup, make_agent_rollout_fn
from training.openai_api.tool_parsers import (
    HermesToolParser,
    JsonToolParser,
    ParsedCalls,
    ToolCall,
    ToolParser,
    get_tool_parser,
    render_prompt_ids,
)
from training.agents.tools import FunctionTool, Tool, ToolManager, ToolResult
from training.agents.trajectory import Episode, TrajectoryEngine
from training.utils.rl.credit import discounted, same_return

__all__ = [
    "Action",
    "AgentStep",
    "ConversationAgent",
    "ModelAgent",
    "StepResult",
    "ToolAgent",
    "FINISH_TOOL",
    "Environment",
    "FinishTool",
    "IntermediateRewards",
    "TaskEnvironment",
    "ToolEnvironment",
    "Orchestrator",
    "TrajectoryGroup",
    "engine_for_setup",
    "make_agent_rollout_fn",
    "HermesToolParser",
    "JsonToolParser",
    "ParsedCalls",
    "ToolParser",
    "get_tool_parser",
    "render_prompt_ids",
    "FunctionTool",
    "Tool",
    "ToolCall",
    "ToolManager",
    "ToolResult",
    "Episode",
    "TrajectoryEngine",
    "discounted",
    "same_return",
]
