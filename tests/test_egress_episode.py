"""Egress in episodes: the record of each exec and of the outcome, a network for each
phase (the agent's, the grader's ctx.run), credentials from the trainer only, and the
battery's two egress attacks. Real curl inside real sandboxes; the servers listen on the
host's 127.0.0.1 and the names resolve through the test's own table, never real DNS."""
from __future__ import annotations

import json
import os
import shlex

import pytest

from egress_servers import file_server, sandboxes_proxy
from envs.networked import Fetched
from karotte import net
from karotte.battery import pick_attacks, redteam
from karotte.cli.main import main as karotte_main
from karotte.egress import EgressConfigError, EgressProcess, parse_policy
from karotte.environment import Network, check_environment
from karotte.episode import Episode
from karotte.grader_runtime import decode_result, encode_result
from karotte.outcome import EPISODE_REACHES
from karotte.results import EXEC_REACHES, REACH_TEXT_LIMIT, EgressRecord, Reach
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec

NAMES = {"task.test": ["127.0.0.1"], "grader.test": ["127.0.0.1"], "evil.test": ["127.0.0.1"]}
SECRET_ENV = "sk-env-6f1d0a9c3b"  # headers_from_env's, from this process's environment
SECRET_ARG = "sk-arg-27e4b8c1d5"  # Episode(upstream_headers=...)'s


@pytest.fixture(autouse=True)
def proxy():
    with sandboxes_proxy(NAMES) as egress:
        yield egress


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    with file_server(tmp_path_factory.mktemp("task"), {"data.txt": "21\n"}) as server:
        yield server


@pytest.fixture(scope="module")
def grader(tmp_path_factory):
    with file_server(tmp_path_factory.mktemp("grader"), {"answer.txt": "42\n"}) as server:
        yield server


def on(name, server):
    """The allow-list entries that reach server by name (and its loopback address)."""
    return (f"{name}:{server.port}", f"127.0.0.1:{server.port}")


@pytest.fixture
def fetched(monkeypatch, task, grader):
    """Fetched, its agent on task.test's list and its grader's runs on grader.test's."""
    monkeypatch.setattr(Fetched, "network", Network(allow=on("task.test", task)))
    monkeypatch.setattr(Fetched, "grader_network", Network(allow=on("grader.test", grader)))
    monkeypatch.setattr(Fetched, "task_url", f"http://task.test:{task.port}")
    monkeypatch.setattr(Fetched, "answer_url", f"http://grader.test:{grader.port}")
    return Fetched()


def reached(record):
    return [(r.host, r.allowed, r.reason) for r in record.reaches]


def test_each_exec_and_the_outcome_record_what_the_agent_reached(fetched, task):
    with Episode(fetched, seed=1) as ep:
        ep.reset()
        good = ep.exec(f"n=$(curl -sSf http://task.test:{task.port}/data.txt) && "
                       "echo $((n * 2)) > answer.txt")
        bad = ep.exec(f"curl -sS -o /dev/null -w '%{{http_code}}' "
                      f"http://evil.test:{task.port}/data.txt")
        quiet = ep.exec("true")
        outcome = ep.finish()
    assert good.exit_code == 0 and reached(good.egress) == [("task.test", True, "ok")]
    assert good.egress.reaches[0].bytes_received > 0 and good.egress.dropped == 0
    assert bad.text == "403" and reached(bad.egress) == [("evil.test", False, "not_allowed")]
    assert quiet.egress == EgressRecord()
    assert outcome.reason == "graded" and outcome.reward == 1.0
    assert reached(outcome.egress) == [("task.test", True, "ok"),
                                       ("evil.test", False, "not_allowed")]
    assert [(r.reaches, r.refused) for r in outcome.log] == [(1, 0), (1, 1), (0, 0)]
    data = json.loads(json.dumps(outcome.to_dict()))
    assert [r["host"] for r in data["egress"]["reaches"]] == ["task.test", "evil.test"]
    assert data["log"][1]["refused"] == 1


def test_EGRESS_PHASE_01_the_graders_list_is_its_own_the_agent_cannot_reach_it(fetched, grader):
    with Episode(fetched, seed=1) as ep:
        ep.reset()
        tried = ep.exec(f"curl -sSf http://grader.test:{grader.port}/answer.txt > answer.txt; "
                        f"curl -sSf --noproxy '' -x http://127.0.0.1:3128 "
                        f"http://127.0.0.1:{grader.port}/answer.txt "
                        ">> answer.txt")
        outcome = ep.finish()
    assert reached(tried.egress) == [("grader.test", False, "not_allowed"),
                                     ("127.0.0.1", False, "ip_literal")]
    assert outcome.reward == 0.0  # nothing the agent could fetch
    # ...and ctx.run reached it, under the grader's own list
    assert outcome.details["run_exit"] == 0 and outcome.details["run_stdout"] == "42\n"
    assert outcome.details["run_reaches"] == [["grader.test", True, "ok"]]
    assert reached(outcome.grader_egress) == [("grader.test", True, "ok")]
    assert not [v for v in outcome.details["grader_environ"] if "proxy" in v.lower()]


def test_without_a_network_the_records_are_none(task):
    with Sandbox(SandboxSpec()) as sb:
        assert sb.exec("true").egress is None and sb.egress_record() is None
    env = Fetched()  # network None for both phases
    with Episode(env, seed=1) as ep:
        ep.reset()
        r = ep.exec(f"curl -sS --max-time 3 http://task.test:{task.port}/data.txt")
        outcome = ep.finish()
    assert r.exit_code != 0 and r.egress is None
    assert outcome.egress is None and outcome.grader_egress is None
    assert outcome.to_dict()["egress"] is None


def flood(sb, n, host="x.evil.test"):
    """n refused requests, one connection each, from one exec."""
    code = (f"import socket\nfor i in range({n}):\n"
            "    s = socket.create_connection(('127.0.0.1', 3128))\n"
            f"    s.sendall(b'GET http://{host}/ HTTP/1.1\\r\\nHost: {host}\\r\\n"
            "Connection: close\\r\\n\\r\\n')\n"
            "    while s.recv(65536): pass\n")
    return sb.exec(["python3", "-c", code], timeout=120)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_an_exec_holds_the_reaches_opened_while_it_ran_only(where, task):
    served = EgressProcess(hosts=NAMES) if where == "process" else None
    old = net.use_egress_proxy(served) if served else None
    try:
        with Sandbox(SandboxSpec(network=parse_policy(on("task.test", task)))) as sb:
            first = sb.exec(f"curl -sSf http://task.test:{task.port}/data.txt")
            # a background request that starts after this exec ended
            sb.exec(f"(sleep 0.5; curl -s http://evil.test:{task.port}/) >/dev/null 2>&1 &")
            sb.exec("sleep 1.5")
            second = sb.exec(f"curl -s http://evil.test:{task.port}/x; "
                             f"curl -sSf http://task.test:{task.port}/data.txt")
            full = flood(sb, 1000)  # the proxy's log holds 1000 reaches a sandbox
            past = flood(sb, 7)
            whole = sb.egress_record()
    finally:
        if served:
            net.use_egress_proxy(old)
            served.close()
    assert first.stdout == b"21\n" and reached(first.egress) == [("task.test", True, "ok")]
    assert reached(second.egress) == [("evil.test", False, "not_allowed"),
                                      ("task.test", True, "ok")]
    assert [r.host for r in whole.reaches[:4]] == ["task.test", "evil.test", "evil.test",
                                                   "task.test"]
    assert (len(full.egress.reaches), full.egress.total) == (EXEC_REACHES, 1000)
    assert (past.egress.reaches, past.egress.dropped) == ((), 7)  # counted, never held
    assert (len(whole.reaches), whole.dropped) == (1000, 11)


def test_EGRESS_REC_BOUND_01_a_flood_of_refused_requests_keeps_every_record_bounded(fetched):
    flood = 1500
    host = "\u00e9" * 60 + ".evil.test"  # non-ASCII: 6 bytes of JSON a character at most
    code = (
        "import socket\n"
        f"for i in range({flood}):\n"
        "    s = socket.create_connection(('127.0.0.1', 3128))\n"
        f"    s.sendall(('GET http://%d{host}/ HTTP/1.1\\r\\nHost: %d{host}\\r\\n"
        "Connection: close\\r\\n\\r\\n' % (i, i)).encode())\n"
        "    while s.recv(65536): pass\n"
        "    s.close()\n")
    with Episode(fetched, seed=1) as ep:
        ep.reset()
        r = ep.exec(f"python3 -c {shlex.quote(code)}", timeout=120)
        outcome = ep.finish()
    assert r.exit_code == 0, r.text
    assert len(r.egress.reaches) == EXEC_REACHES and r.egress.total == flood
    assert all(not x.allowed for x in r.egress.reaches)
    held = outcome.egress
    assert len(held.reaches) <= EPISODE_REACHES and held.total == flood
    for x in held.reaches + r.egress.reaches:
        assert len(json.dumps(x.host)) <= REACH_TEXT_LIMIT
        assert len(json.dumps(x.detail)) <= REACH_TEXT_LIMIT
    size = len(json.dumps(outcome.to_dict()["egress"]))
    assert size <= EPISODE_REACHES * (2 * REACH_TEXT_LIMIT + 200), size
    assert len(json.dumps(outcome.to_dict())) < 1024 * 1024  # the whole record (REC-BOUND-01)


def test_upstream_credentials_come_from_the_trainer_and_enter_no_sandbox_or_record(
        monkeypatch, task, grader):
    monkeypatch.setenv("KAROTTE_TEST_MODEL_KEY", f"Bearer {SECRET_ENV}")
    monkeypatch.setattr(Fetched, "network", Network(
        allow=on("task.test", task), upstreams={"model": f"http://127.0.0.1:{task.port}"},
        headers_from_env={"model": {"Authorization": "KAROTTE_TEST_MODEL_KEY"}}))
    monkeypatch.setattr(Fetched, "grader_network", Network(
        allow=(f"127.0.0.1:{grader.port}",),
        upstreams={"judge": f"http://127.0.0.1:{grader.port}"}))
    monkeypatch.setattr(Fetched, "answer_url", "")
    monkeypatch.setattr(Fetched, "grader_command",
                        'env; cat /proc/[0-9]*/environ | tr "\\0" "\\n"; '
                        'curl -sSf "$KAROTTE_UPSTREAM_JUDGE/answer.txt"')
    task.seen.clear()
    grader.seen.clear()
    with Episode(Fetched(), seed=1,
                 upstream_headers={"judge": {"X-Judge-Key": SECRET_ARG}}) as ep:
        ep.reset()
        r = ep.exec('n=$(curl -sSf "$KAROTTE_UPSTREAM_MODEL/data.txt") && '
                    "echo $((n * 2)) > answer.txt; env; "
                    'cat /proc/[0-9]*/environ | tr "\\0" "\\n"; grep -rl sk- /workspace /tmp')
        outcome = ep.finish()
    assert r.exit_code is not None and "KAROTTE_UPSTREAM_MODEL=http://127.0.0.1:3129" in r.text
    assert reached(r.egress) == [("127.0.0.1", True, "ok")]
    assert r.egress.reaches[0].via == "upstream:model"
    # the servers got the keys, from the host side
    assert task.seen[-1][2]["Authorization"] == f"Bearer {SECRET_ENV}"
    assert grader.seen[-1][2]["X-Judge-Key"] == SECRET_ARG
    assert outcome.reward == 1.0 and outcome.details["run_stdout"].endswith("42\n")
    assert "KAROTTE_UPSTREAM_JUDGE=http://127.0.0.1:3129" in outcome.details["run_stdout"]
    # ...and nothing of them is in the agent's view, the grader's, or any record
    everything = r.text + json.dumps(outcome.to_dict()) + repr(outcome) + repr(r)
    for secret in (SECRET_ENV, SECRET_ARG):
        assert secret not in everything
    assert "KAROTTE_TEST_MODEL_KEY" not in everything  # not even the variable


def test_a_declared_variable_that_is_not_set_fails_before_any_sandbox(monkeypatch, task):
    monkeypatch.delenv("KAROTTE_TEST_MISSING", raising=False)
    monkeypatch.setattr(Fetched, "network", Network(
        allow=on("task.test", task), upstreams={"model": f"http://127.0.0.1:{task.port}"},
        headers_from_env={"model": {"Authorization": "KAROTTE_TEST_MISSING"}}))
    with pytest.raises(EgressConfigError, match=r"Fetched\.network: .*KAROTTE_TEST_MISSING.*"
                                                r"export KAROTTE_TEST_MISSING="):
        Episode(Fetched(), seed=1)
    with pytest.raises(ValueError, match=r"upstream_headers names the upstreams \['modle'\]"):
        Episode(Fetched(), seed=1, upstream_headers={"modle": {"Authorization": "x"}})


def parse_policy_of(network: Network):
    from karotte.grading import phase_policy
    return phase_policy(network, None, "Env.network")


def test_a_network_is_declared_as_plain_data_in_one_place(monkeypatch):
    with pytest.raises(TypeError, match="Network.allow is a tuple of entries"):
        Network(allow="pypi.org")
    with pytest.raises(TypeError, match="headers come from the trainer"):
        Network(upstreams={"model": {"url": "https://x.test", "headers": {"A": "key"}}})
    with pytest.raises(ValueError, match=r"headers_from_env names the upstreams \['llm'\]"):
        Network(headers_from_env={"llm": {"Authorization": "KEY"}})
    with pytest.raises(ValueError, match="Network.mode is 'proxy' or 'ip'"):
        Network(mode="bridge")
    with pytest.raises(ValueError, match="the ip mode has none"):
        Network(upstreams={"model": "https://x.test"}, mode="ip")
    assert parse_policy_of(Network(allow=("10.0.0.5:5432",), mode="ip")).mode == "ip"
    monkeypatch.setattr(Fetched, "network", Network(allow=("not a host!",)))
    with pytest.raises(EgressConfigError, match=r"Fetched\.network: allow-list entry"):
        Episode(Fetched(), seed=1)
    monkeypatch.setattr(Fetched, "network", ["pypi.org"])
    with pytest.raises(TypeError, match=r"Fetched\.network must be a karotte.environment"):
        check_environment(Fetched())
    monkeypatch.setattr(Fetched, "network", None)
    monkeypatch.setattr(Fetched, "limits", SandboxSpec(network=parse_policy(["pypi.org"])))
    with pytest.raises(ValueError, match=r"declare it as Fetched\.network = Network"):
        check_environment(Fetched())


def test_a_ctx_run_result_carries_its_record_across_the_channel():
    record = EgressRecord((Reach("connect", "grader.test", 443, True, "ok", 10, 20),), 3)
    from karotte.results import ExecResult
    result = ExecResult(0, None, b"", b"", False, False, False, False, 0.1, 0.0, None,
                        egress=record)
    assert decode_result(json.loads(json.dumps(encode_result(result)))) == result


def test_EGRESS_UNLISTED_01_and_PHASE_01_fail_to_score_when_the_lists_hold(fetched):
    attacks = pick_attacks(fetched, 1, ["egress-unlisted", "egress-grader-list"])
    report = redteam(fetched, attacks=attacks)
    by_name = {r.name: r for r in report.results}
    assert by_name["egress-unlisted"].passed and by_name["egress-unlisted"].reward == 0.0
    assert by_name["egress-grader-list"].passed, by_name["egress-grader-list"].why


def test_EGRESS_PHASE_01_scores_when_the_agent_is_on_the_graders_list_too(
        monkeypatch, fetched, grader):
    """The attack can fail: an author who put the answer server on both lists."""
    monkeypatch.setattr(Fetched, "network", Network(allow=on("grader.test", grader)))
    report = redteam(fetched, attacks=pick_attacks(fetched, 1, ["egress-grader-list"]))
    result = next(r for r in report.results if r.name == "egress-grader-list")
    assert not result.passed and result.reward == 1.0, result.why


def test_karotte_run_json_has_the_outcomes_egress(fetched, capsys):
    assert karotte_main(["run", "envs.networked:Fetched", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert record["reward"] == 1.0  # the reference solution
    assert [(r["host"], r["allowed"]) for r in record["egress"]["reaches"]] == [
        ("task.test", True)]
    assert [r["host"] for r in record["grader_egress"]["reaches"]] == ["grader.test"]
    assert os.environ.get("KAROTTE_TEST_MODEL_KEY") is None
