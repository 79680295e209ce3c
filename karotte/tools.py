"""The agent's tools for LLM clients: JSON schemas and one dispatcher, for both faces.

    from karotte.tools import openai_tools, anthropic_tools, call_tool, acall_tool

    tools = anthropic_tools()                 # or openai_tools() / openai_tools("responses")
    with Episode(env, seed) as ep:
        messages = [{"role": "user", "content": ep.reset()}]
        while True:
            reply = client.messages.create(model=..., tools=tools, messages=messages)
            calls = [b for b in reply.content if b.type == "tool_use"]
            if not calls:
                break
            results = [{"type": "tool_result", "tool_use_id": c.id,
                        "content": call_tool(ep, c.name, c.input)} for c in calls]
            messages += [{"role": "assistant", "content": reply.content},
                         {"role": "user", "content": results}]
            if ep.done:
                break
        outcome = ep.finish()

With an AsyncEpisode the loop is the same with ``await acall_tool(ep, name, arguments)``.
What the model sees is the same from both: the checks of a call and the texts of its
result are written once, here.
"""
from __future__ import annotations

import json
from functools import partial
from typing import Any, Callable, Mapping

from .episode import AsyncEpisode, Episode, ToolResult

TOOLS: tuple[dict[str, Any], ...] = (
    {
        "name": "bash",
        "description": (
            "Run a bash command in your sandbox (a Linux machine with no network). The working "
            "directory and exported variables carry over to the next command. Each command "
            "has a time limit; long output is cut, with a note saying so."),
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command."}},
            "required": ["command"],
            "additionalProperties": False,
        },
    },
    {
        "name": "read_file",
        "description": "Read a text file. Relative paths are under /workspace.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
    {
        "name": "write_file",
        "description": ("Write a text file, replacing it if it exists. Relative paths are under "
                        "/workspace. The directory must exist."),
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
            "additionalProperties": False,
        },
    },
    {
        "name": "give_up",
        "description": ("Stop working on the task because you cannot complete it. This ends "
                        "the episode at once; it is always better than pretending."),
        "parameters": {"type": "object", "properties": {}, "required": [],
                       "additionalProperties": False},
    },
)
# Every schema fits OpenAI's strict mode: each property required, no other property.
# The Episode method each tool calls, with the required arguments in their order.
_METHODS = {"bash": "exec", "read_file": "read_file", "write_file": "write_file",
            "give_up": "give_up"}


def openai_tools(api: str = "chat") -> list[dict[str, Any]]:
    """The tools in the form OpenAI's APIs take (`tools=`): api="chat" for Chat Completions
    and OpenAI-compatible servers ({"type": "function", "function": {...}}), api="responses"
    for the Responses API (flat FunctionToolParam, with strict=True)."""
    if api == "chat":
        return [{"type": "function", "function": {
            "name": t["name"], "description": t["description"], "parameters": t["parameters"]}}
            for t in TOOLS]
    if api == "responses":
        return [{"type": "function", "name": t["name"], "description": t["description"],
                 "parameters": t["parameters"], "strict": True} for t in TOOLS]
    raise ValueError(f"api must be 'chat' or 'responses', got {api!r}")


def anthropic_tools() -> list[dict[str, Any]]:
    """The tools in the form the Anthropic Messages API takes (`tools=`)."""
    return [{"name": t["name"], "description": t["description"],
             "input_schema": t["parameters"]} for t in TOOLS]


_WRONG_FACE = {
    Episode: "call_tool runs an Episode's tools; for an AsyncEpisode use "
             "`await acall_tool(ep, name, arguments)`",
    AsyncEpisode: "acall_tool runs an AsyncEpisode's tools; for an Episode use "
                  "call_tool(ep, name, arguments)",
}


def call_tool(episode: Episode, name: str, arguments: Mapping[str, Any] | str) -> str:
    """Run one tool call of the model and return what the model should see. Bad calls
    (unknown tool, missing argument, a NUL byte or an over-long argument, a call after
    the episode ended or past its budget) come back as text, so the model can correct
    itself. For an AsyncEpisode: await acall_tool()."""
    step = _step(episode, Episode, name, arguments)
    return step if isinstance(step, str) else _reply(name, step())


async def acall_tool(episode: AsyncEpisode, name: str, arguments: Mapping[str, Any] | str) -> str:
    """call_tool for an AsyncEpisode: the same checks, the same texts."""
    step = _step(episode, AsyncEpisode, name, arguments)
    return step if isinstance(step, str) else _reply(name, await step())


def _step(episode: Episode | AsyncEpisode, face: type, name: str,
          arguments: Mapping[str, Any] | str) -> str | Callable[[], Any]:
    """The call of the episode's method that runs the tool, or the text that answers a bad
    call."""
    if not isinstance(episode, face):
        raise TypeError(_WRONG_FACE[face] + f" (got {type(episode).__name__})")
    if isinstance(arguments, str):  # OpenAI passes arguments as a JSON string
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            return f"error: the arguments of {name} are not valid JSON"
    if not isinstance(arguments, Mapping):
        return f"error: the arguments of {name} must be an object"
    spec = next((t for t in TOOLS if t["name"] == name), None)
    if spec is None:
        return f"error: there is no tool named {name!r}; the tools are " + ", ".join(
            t["name"] for t in TOOLS)
    missing = [k for k in spec["parameters"]["required"] if not isinstance(arguments.get(k), str)]
    if missing:
        return f"error: {name} needs the string argument(s) {', '.join(missing)}"
    if episode.done:  # e.g. give_up came first among parallel tool calls
        return f"error: the episode is over; {name} was not run"
    return partial(getattr(episode, _METHODS[name]),
                   *(arguments[k] for k in spec["parameters"]["required"]))


def _reply(name: str, result: ToolResult | Any) -> str:
    """What the model sees of a call's result. Never empty: a model shown '' cannot tell
    a silent success from a tool that did not answer."""
    if name == "give_up":
        return "You gave up; the episode is over."
    if result.exit_code == 0 and name != "bash":
        return "written" if name == "write_file" else result.text or "(the file is empty)"
    if not result.text:
        return f"(no output, exit status {result.exit_code})"
    if name == "bash" and result.exit_code not in (0, None):
        return result.text + f"\n[exit status {result.exit_code}]"
    return result.text
