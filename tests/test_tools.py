"""The LLM tool schemas and the dispatcher, driven as a model would call them."""
from __future__ import annotations

import json

from envs.basic import Addition
from karotte.episode import MAX_ARGUMENT, Episode
from karotte.tools import anthropic_tools, call_tool, openai_tools

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
        assert "[exit status 3]" in call_tool(ep, "bash", {"command": "exit 3"})
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
        assert call_tool(ep, "bash", {"command": near}) == ""
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
