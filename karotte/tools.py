"""The agent's tools for LLM clients: JSON schemas and one dispatcher.

    from karotte.tools import openai_tools, anthropic_tools, call_tool

    tools = anthropic_tools()                 # or openai_tools() for OpenAI-compatible APIs
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
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from .episode import Episode

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
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
)


def openai_tools() -> list[dict[str, Any]]:
    """The tools in the form OpenAI-compatible chat APIs take (`tools=`)."""
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["parameters"]}} for t in TOOLS]


def anthropic_tools() -> list[dict[str, Any]]:
    """The tools in the form the Anthropic Messages API takes (`tools=`)."""
    return [{"name": t["name"], "description": t["description"],
             "input_schema": t["parameters"]} for t in TOOLS]


def call_tool(episode: Episode, name: str, arguments: Mapping[str, Any] | str) -> str:
    """Run one tool call of the model and return what the model should see. Bad calls
    (unknown tool, missing argument, a NUL byte or an over-long argument, a call after
    the episode ended) come back as text, so the model can correct itself."""
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
    missing = [k for k in spec["parameters"].get("required", ()) if not isinstance(
        arguments.get(k), str)]
    if missing:
        return f"error: {name} needs the string argument(s) {', '.join(missing)}"
    if episode.done:  # e.g. give_up came first among parallel tool calls
        return f"error: the episode is over; {name} was not run"
    if name == "bash":
        result = episode.exec(arguments["command"])
        return result.text + ("" if result.exit_code in (0, None) else
                              f"\n[exit status {result.exit_code}]")
    if name == "read_file":
        return episode.read_file(arguments["path"]).text
    if name == "write_file":
        r = episode.write_file(arguments["path"], arguments["content"])
        return "written" if r.exit_code == 0 else r.text
    episode.give_up()
    return "You gave up; the episode is over."
