"""The LLM tool schemas and the dispatcher, driven as a model would call them."""
from __future__ import annotations

import asyncio
import json

import pytest

from envs.basic import Addition
from karotte.episode import MAX_ARGUMENT, AsyncEpisode, Episode
from karotte.tools import TOOLS, acall_tool, anthropic_tools, call_tool, openai_tools

NAMES = ["bash", "read_file", "write_file", "give_up"]


def test_schemas_have_the_shapes_both_client_kinds_take():
    oa = openai_tools()
    assert [t["function"]["name"] for t in oa] == NAMES
    for t in oa:
        assert t["type"] == "function"
        assert t["function"]["parameters"]["type"] == "object"
        assert t["function"]["description"]
    an = anthropic_tools()
    assert [t["name"] for t in an] == NAMES
    for t in an:
        assert set(t) == {"name", "description", "input_schema"}
        assert t["input_schema"]["type"] == "object"
    json.dumps(oa), json.dumps(an)  # plain JSON


def test_a_model_can_solve_the_task_through_the_tools(no_leaks):
    env = Addition()
    with Episode(env, seed=4) as ep:
        ep.reset()
        numbers = call_tool(ep, "read_file", {"path": "numbers.txt"})
        a, b = map(int, numbers.split())
        assert call_tool(ep, "write_file", json.dumps({"path": "answer.txt",
                                                       "content": f"{a + b}\n"})) == "written"
        assert call_tool(ep, "bash", {"command": "cat answer.txt"}) == f"{a + b}\n"
        assert call_tool(ep, "bash", {"command": "echo no; exit 3"}) == "no\n\n[exit status 3]"
        outcome = ep.finish()
    assert outcome.reward == 1.0
    assert [r.tool for r in outcome.log] == ["read_file", "write_file", "bash", "bash"]


def test_bad_calls_come_back_as_text_the_model_can_act_on(no_leaks):
    with Episode(Addition(), seed=4) as ep:
        ep.reset()
        assert "no tool named 'rm_rf'" in call_tool(ep, "rm_rf", {})
        assert "needs the string argument(s) command" in call_tool(ep, "bash", {})
        assert "not valid JSON" in call_tool(ep, "bash", "{oops")
        assert "must be an object" in call_tool(ep, "bash", "[1]")


def test_give_up_through_the_tool_ends_the_episode(no_leaks):
    with Episode(Addition(), seed=4) as ep:
        ep.reset()
        assert "over" in call_tool(ep, "give_up", {})
        assert ep.done
        assert ep.finish().reason == "gave_up"


def test_calls_no_process_could_take_come_back_as_text_and_the_episode_goes_on(no_leaks):
    # A model's output is untrusted: a NUL byte or a 300 KB heredoc must not raise into
    # the trainer's loop (an exception there drops the sample: XEP-FAILOPEN-01).
    with Episode(Addition(), seed=4) as ep:
        ep.reset()
        assert "NUL byte" in call_tool(ep, "bash", {"command": "echo a\0b"})
        assert "NUL byte" in call_tool(ep, "read_file", {"path": "answer\0.txt"})
        assert "NUL byte" in call_tool(ep, "write_file", {"path": "a\0", "content": "x"})
        heredoc = "cat > big.txt <<'EOF'\n" + "x" * 300_000 + "\nEOF"
        assert "over the limit" in call_tool(ep, "bash", {"command": heredoc})
        # the way to write it, and what the shell can take, still work
        assert call_tool(ep, "write_file", {"path": "big.txt", "content": "x" * 300_000}) == "written"
        near = "true " + "#" * (MAX_ARGUMENT - 6)
        assert call_tool(ep, "bash", {"command": near}) == "(no output, exit status 0)"
        assert call_tool(ep, "bash", {"command": "wc -c < big.txt"}).strip() == "300000"
        assert [r.exit_code for r in ep.finish().log] == [None, None, None, None, 0, 0, 0]


def test_parallel_calls_after_give_up_come_back_as_text(no_leaks):
    with Episode(Addition(), seed=4) as ep:
        ep.reset()
        replies = [call_tool(ep, name, args) for name, args in
                   [("give_up", {}), ("bash", {"command": "true"}), ("read_file", {"path": "x"})]]
        assert "over" in replies[0]
        assert all(r.startswith("error: the episode is over") for r in replies[1:])
        assert ep.finish().reason == "gave_up"


def test_the_responses_api_form_is_flat_and_strict():
    tools = openai_tools("responses")
    assert [t["name"] for t in tools] == NAMES
    for t, spec in zip(tools, TOOLS):
        assert t == {"type": "function", "name": spec["name"], "description": spec["description"],
                     "parameters": spec["parameters"], "strict": True}
    assert openai_tools() == openai_tools("chat")
    with pytest.raises(ValueError, match="'chat' or 'responses'"):
        openai_tools("completions")


def test_every_schema_fits_openai_strict_mode():
    # Strict mode refuses a schema with an optional property or without
    # additionalProperties false, at the first request.
    for t in TOOLS:
        schema = t["parameters"]
        assert schema["type"] == "object" and schema["additionalProperties"] is False, t["name"]
        assert schema["required"] == list(schema["properties"]), t["name"]
        assert all(p["type"] == "string" for p in schema["properties"].values()), t["name"]


def test_a_silent_command_or_an_empty_file_tells_the_model_so(no_leaks):
    with Episode(Addition(), seed=4) as ep:
        ep.reset()
        assert call_tool(ep, "bash", {"command": "true"}) == "(no output, exit status 0)"
        assert call_tool(ep, "bash", {"command": "exit 3"}) == "(no output, exit status 3)"
        assert call_tool(ep, "write_file", {"path": "empty", "content": ""}) == "written"
        assert call_tool(ep, "read_file", {"path": "empty"}) == "(the file is empty)"


def test_acall_tool_drives_an_async_episode_as_call_tool_drives_a_sync_one(no_leaks):
    async def main():
        async with AsyncEpisode(Addition(), seed=4) as ep:
            await ep.reset()
            numbers = await acall_tool(ep, "read_file", {"path": "numbers.txt"})
            a, b = map(int, numbers.split())
            written = await acall_tool(ep, "write_file", json.dumps(
                {"path": "answer.txt", "content": f"{a + b}\n"}))
            silent = await acall_tool(ep, "bash", {"command": "true"})
            bad = await acall_tool(ep, "bash", {})
            return written, silent, bad, await ep.finish()

    written, silent, bad, outcome = asyncio.run(main())
    assert (written, silent) == ("written", "(no output, exit status 0)")
    assert "needs the string argument(s) command" in bad
    assert outcome.reward == 1.0


def test_the_wrong_dispatcher_for_a_face_names_the_right_one():
    with pytest.raises(TypeError, match="await acall_tool"):
        call_tool(AsyncEpisode(Addition(), seed=4), "bash", {"command": "true"})
    with pytest.raises(TypeError, match="use call_tool"):
        asyncio.run(acall_tool(Episode(Addition(), seed=4), "bash", {"command": "true"}))


def test_a_lone_surrogate_from_the_model_comes_back_as_text(no_leaks):
    # json.loads('"\\ud800"') is a str no encoder takes: it must not raise into the loop.
    with Episode(Addition(), seed=4) as ep:
        ep.reset()
        reply = call_tool(ep, "bash", '{"command": "echo \\ud800"}')
        assert "not valid text" in reply
        assert call_tool(ep, "bash", {"command": "echo ok"}) == "ok\n"


def test_the_call_past_the_budget_tells_the_model_the_episode_is_over(no_leaks):
    with Episode(Addition(), seed=4, max_turns=1) as ep:
        ep.reset()
        assert call_tool(ep, "bash", {"command": "echo one"}) == "one\n"
        reply = call_tool(ep, "bash", {"command": "echo two"})
        assert "budget of 1 tool calls is used up" in reply and "episode is over" in reply
        assert ep.done
        assert call_tool(ep, "bash", {"command": "echo three"}).startswith(
            "error: the episode is over")
