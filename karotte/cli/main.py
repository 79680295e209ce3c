"""karotte: create, run and check RL environments.

    karotte create-env NAME                 a new environment project, tested and checked
    karotte run ENV [-n N] [--seed S] [--concurrency K] [--agent FILE] [--json] [--out FILE]
    karotte check ENV [--json]              reference, null agent and the attack battery
    karotte image import|build|ls|inspect|verify|rm|gc   the images tasks run on

ENV is a module holding one Environment (karotte.examples.q3_revenue) or module:Name.
The current directory is on the import path, so a freshly created project works as is.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from .. import __version__
from . import image as image_cli

EXIT_INFRA = 1
EXIT_USAGE = 2
SHOWN_GRADER_FAILURES = 3  # episodes whose grader failed that a summary shows the log of


def _load_env(target: str, command: str):
    """The environment, or None after saying on stderr why it cannot be loaded."""
    from ..environment import load

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        env = load(target)()
    except (ImportError, ValueError, TypeError, AttributeError) as exc:
        print(f"karotte {command}: cannot load {target!r}: {exc}", file=sys.stderr)
        return None
    image_cli.announce_first_imports(env, command)  # the first episode's import is silent
    return env


# --------------------------------------------------------------------------- agents


@dataclasses.dataclass(frozen=True)
class ToolCall:
    tool: str  # bash, read_file, write_file, give_up
    arguments: dict[str, Any]


def parse_agent(text: str, source: str = "agent file") -> list[ToolCall]:
    """One bash command per line (blank lines and # comments ignored), or JSON Lines of
    tool calls: {"tool": "bash", "command": ...}, {"tool": "write_file", "path": ...,
    "content": ...}, {"tool": "read_file", "path": ...}, {"tool": "give_up"}; the OpenAI
    form {"name": ..., "arguments": {...}} is accepted too."""
    from ..tools import TOOLS

    required = {t["name"]: t["parameters"].get("required", ()) for t in TOOLS}
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1)
             if line.strip() and not line.lstrip().startswith("#")]
    if not lines or not lines[0][1].lstrip().startswith("{"):
        return [ToolCall("bash", {"command": line}) for _, line in lines]
    calls = []
    for number, line in lines:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{source}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{source}:{number}: a tool call must be a JSON object")
        name = obj.get("tool", obj.get("name"))
        args = obj.get("arguments", {k: v for k, v in obj.items() if k != "tool"})
        if isinstance(args, str):
            args = json.loads(args)
        if name not in required:
            raise ValueError(f"{source}:{number}: unknown tool {name!r} "
                             "(bash, read_file, write_file, give_up)")
        if not isinstance(args, dict):
            raise ValueError(f"{source}:{number}: the arguments must be a JSON object")
        for arg in required[name]:
            if not isinstance(args.get(arg), str):
                raise ValueError(f"{source}:{number}: {name} needs a string {arg!r}")
        calls.append(ToolCall(name, dict(args)))
    return calls


async def _play(env, seed: int, calls: Sequence[ToolCall] | None, limiter=None):
    from ..episode import AsyncEpisode

    async with AsyncEpisode(env, seed=seed, limiter=limiter) as ep:
        await ep.reset()
        plan = calls if calls is not None else [ToolCall("bash", {"command": c})
                                                 for c in ep.reference_solution()]
        for call in plan:
            if call.tool == "give_up":
                return await ep.give_up()
            if call.tool == "bash":
                await ep.exec(call.arguments["command"])
            elif call.tool == "read_file":
                await ep.read_file(call.arguments["path"])
            else:
                await ep.write_file(call.arguments["path"], call.arguments["content"])
        return await ep.finish()


def outcome_json(target: str, seed: int, outcome) -> dict:
    """One record of `karotte run --json`: Outcome.to_dict() (bounded, plain JSON), with
    env as the command line named it."""
    return {**outcome.to_dict(), "env": target, "seed": seed}


def unplayed_json(target: str, seed: int, why: str) -> dict:
    """The record of an episode that could not even start: outcome_json's keys, no result."""
    return {"env": target, "seed": seed, "reward": None, "reason": "infra_error",
            "violations": [], "violations_dropped": 0, "infra_error": why[:4096],
            "timings": {}, "log": [], "details": {}, "details_dropped": 0, "grader_log": "",
            "changed_paths": 0, "deleted_paths": 0, "egress": None, "grader_egress": None,
            "egress_ip": None}


def cmd_run(args: argparse.Namespace) -> int:
    from .. import lifecycle
    from ..limiter import Limiter

    calls = None
    if args.agent:
        try:
            calls = parse_agent(Path(args.agent).read_text(), args.agent)
        except (OSError, ValueError) as exc:
            print(f"karotte run: {exc}", file=sys.stderr)
            return EXIT_USAGE
    env = _load_env(args.env, "run")
    if env is None:
        return EXIT_USAGE
    seeds = list(range(args.seed, args.seed + args.n))
    # Line-buffered: each record reaches the kernel as its line ends, so a SIGKILL of this
    # process loses none that were reported. fsync would add a disk flush per episode,
    # for power loss only, which ends the training run too.
    out = open(args.out, "w", buffering=1) if args.out else None
    progress = sys.stderr.isatty() and not args.json
    records: list[dict] = []
    stopped: list[int] = []  # the signal that ended the run
    limiter = Limiter(args.concurrency)  # this run's own: the process-wide default stays

    def stop(signum: int) -> None:
        if not stopped:
            stopped.append(signum)
        # Every episode in flight ends at once (its sandboxes are killed, no new one
        # starts); the coroutines then unwind by themselves, closing what they hold.
        lifecycle.stop_all(signum)

    async def one(seed: int, gate: asyncio.Semaphore) -> dict | None:
        async with gate:  # episodes not started yet must not start after a signal
            if stopped:
                return None
            try:
                return outcome_json(args.env, seed, await _play(env, seed, calls, limiter))
            except Exception as exc:  # the episode could not even start: the infrastructure's
                return unplayed_json(args.env, seed, f"{type(exc).__name__}: {exc}")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in lifecycle.SIGNALS:
            loop.add_signal_handler(sig, stop, sig)
        gate = asyncio.Semaphore(args.concurrency)
        for done in asyncio.as_completed([one(seed, gate) for seed in seeds]):
            record = await done
            if stopped:  # ended by the signal (or not run): no result
                continue
            records.append(record)
            line = json.dumps(record)
            if out:  # first: a record seen on stdout is in the file, whenever we die
                out.write(line + "\n")
            if args.json:
                print(line, flush=True)
            if progress:
                _progress(len(records), len(seeds))

    try:
        asyncio.run(main())
    finally:
        if out:
            out.close()
        lifecycle.install_signal_handlers()  # the loop's handlers went with it
    if progress:
        print(file=sys.stderr)
    if stopped:
        lifecycle.cleanup()
        print(f"karotte run: stopped by {signal.Signals(stopped[0]).name} after {len(records)} "
              f"of {len(seeds)} episodes", file=sys.stderr)
    if not args.json:
        print(_summary(records))
    if stopped:
        return 128 + stopped[0]
    return EXIT_INFRA if any(r["infra_error"] for r in records) else 0


def _progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} episodes", end="",
          file=sys.stderr, flush=True)


def _summary(records: list[dict]) -> str:
    from ..grading import GRADER_FAILURES, log_tail, why_of

    rewards = [r["reward"] for r in records if r["reward"] is not None and not r["infra_error"]]
    reasons: dict[str, int] = {}
    for r in records:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    violations = sum(len(r["violations"]) for r in records)
    infra = sum(1 for r in records if r["infra_error"])
    lines = [f"episodes      {len(records)}"]
    if rewards:
        lines.append(f"reward        mean {statistics.mean(rewards):.4g}  min {min(rewards):.4g}  "
                     f"max {max(rewards):.4g}")
    lines.append("reasons       " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    lines.append(f"violations    {violations}")
    lines.append(f"infra errors  {infra}")
    phases = ("reset", "agent", "kill", "scan", "grade", "total")
    timed = [r["timings"] for r in records if r["timings"]]
    if timed:
        lines.append("median s      " + "  ".join(
            f"{p} {statistics.median(t[p] for t in timed):.3f}" for p in phases))
    seeds_of: dict[str, list[int]] = {}  # one line per cause: a preflight error is every episode's
    for r in records:
        if r["infra_error"]:
            seeds_of.setdefault(r["infra_error"], []).append(r["seed"])
    for error, seeds in seeds_of.items():
        shown = ", ".join(map(str, sorted(seeds)[:5])) + (", ..." if len(seeds) > 5 else "")
        lines.append(f"infra error (seed {shown}; {len(seeds)} episodes): {error}"
                     if len(seeds) > 1 else f"infra error (seed {shown}): {error}")
    failed = [r for r in records if r["reason"] in GRADER_FAILURES]
    for r in failed[:SHOWN_GRADER_FAILURES]:
        lines.append(f"{r['reason']} (seed {r['seed']})")
        lines += grader_said(why_of(r.get("details") or {}), log_tail(r.get("grader_log") or ""),
                             "  ")
    if len(failed) > SHOWN_GRADER_FAILURES:
        lines.append(f"... and {len(failed) - SHOWN_GRADER_FAILURES} more episodes whose grader "
                     "failed (--json has every record)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- check


def cmd_check(args: argparse.Namespace) -> int:
    from ..battery import check

    env = _load_env(args.env, "check")
    if env is None:
        return EXIT_USAGE
    live = sys.stderr.isatty() and not args.json
    report = check(env, seed=args.seed, progress=_live_progress(live))
    if live:
        print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    return _report(report, args.json, "karotte check")


def _report(report, as_json: bool, title: str) -> int:
    if as_json:
        print(json.dumps({"env": report.env, "passed": report.passed, "seconds": report.seconds,
                          "results": [dataclasses.asdict(r) for r in report.results]}))
    else:
        print(render_check(report, title))
    return 0 if report.passed else 1


def _live_progress(enabled: bool):
    if not enabled:
        return None
    return lambda name: print(f"\r  checked {name:<40}", end="", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- redteam


def agent_and_ceiling(text: str, reward_range: tuple[float, float]) -> tuple[str, float | None]:
    """--agent FILE or FILE:MAX -> (FILE, MAX or None). A name that exists as a file is
    that file, colons and all; MAX must lie in the environment's reward range."""
    path, sep, tail = text.rpartition(":")
    if os.path.exists(text) or not sep:
        return text, None
    try:
        ceiling = float(tail)
    except ValueError:
        raise ValueError(f"--agent {text}: no such file, and {tail!r} is not a ceiling "
                         "(FILE or FILE:MAX, MAX a number)") from None
    bottom, top = reward_range
    if not bottom <= ceiling <= top:
        raise ValueError(f"--agent {text}: the ceiling {ceiling:g} is outside the reward "
                         f"range [{bottom:g}, {top:g}]")
    return path, ceiling


def cmd_redteam(args: argparse.Namespace) -> int:
    from ..battery import ScriptedAgent, attacks_for, pick_attacks, redteam

    env = _load_env(args.env, "redteam")
    if env is None:
        return EXIT_USAGE
    if args.list:
        battery = attacks_for(env, args.seed)
        width = max(len(a.name) for a in battery)
        for attack in battery:
            print(f"{attack.name:<{width}}  {attack.what}")
        return 0
    agents = []
    for text in args.agent or ():
        try:
            path, ceiling = agent_and_ceiling(text, env.reward_range)
            calls = parse_agent(Path(path).read_text(), path)
        except (OSError, ValueError) as exc:
            print(f"karotte redteam: {exc}", file=sys.stderr)
            return EXIT_USAGE
        steps = tuple(c.arguments["command"] if c.tool == "bash" else (c.tool, c.arguments)
                      for c in calls)
        agents.append(ScriptedAgent(f"agent:{path}", steps, ceiling))
    try:
        attacks = pick_attacks(env, args.seed, args.attack)  # before anything runs
    except ValueError as exc:
        print(f"karotte redteam: {exc}", file=sys.stderr)
        return EXIT_USAGE
    live = sys.stderr.isatty() and not args.json
    try:
        report = redteam(env, seed=args.seed, attacks=attacks,
                         agents=agents, progress=_live_progress(live))
    finally:
        if live:
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    return _report(report, args.json, "karotte redteam")


def grader_said(why: str, tail: Sequence[str], indent: str = "    ") -> list[str]:
    """Lines under a result: the grader's own why, and the tail of its log, each line
    behind a '| ' margin, so that nothing the agent's program printed into the grader's
    stderr can pass for a line of the report (the text comes escaped: log_tail)."""
    lines = [f"{indent}grader's why: {why}"] if why else []
    if tail:
        lines.append(f"{indent}grader log, last {len(tail)} lines (its stdout and stderr, which "
                     "can hold what the agent's program printed; control characters escaped):")
        lines += [f"{indent}| {line}" for line in tail]
    return lines


def render_check(report, title: str = "karotte check") -> str:
    from ..grading import escape

    rows = [("attack", "reward", "reason", "verdict")]
    for r in report.results:
        reward = "" if r.reward is None else f"{r.reward:.4g}"
        rows.append((escape(r.name), reward, r.reason,
                     ("PASS" if r.passed else "FAIL") + "  " + escape(r.why)))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{title} {report.env}"]
    for row, r in zip(rows, (None, *report.results)):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3]))
                     + "  " + row[3])
        if r is not None and (r.grader_log or not r.passed):
            lines += grader_said(r.grader_why, r.grader_log)
    failed = sum(1 for r in report.results if not r.passed)
    lines.append(f"{len(report.results) - failed} passed, {failed} failed "
                 f"({report.seconds:.0f} s)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- create-env


def cmd_create_env(args: argparse.Namespace) -> int:
    from ..scaffold import create_env

    try:
        path = create_env(args.name, Path(args.dir))
    except (ValueError, FileExistsError) as exc:
        print(f"karotte create-env: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"created {path}\n  cd {path}\n  python -m pytest tests     # its own tests\n"
          f"  karotte check {path.name.replace('-', '_')}     # the attack battery")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="karotte", description="Create, run and check robust RL environments on "
                                    "kernel-enforced Linux sandboxes.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("create-env", help="write a new environment project with one working task")
    p.add_argument("name", help="project name (letters, digits, - and _)")
    p.add_argument("--dir", default=".", help="where to create it (default: here)")
    p.set_defaults(func=cmd_create_env)

    p = sub.add_parser("run", help="play episodes: the reference solution, or a scripted agent",
                       description="Exit status: 0 when every episode ran (whatever its "
                                   "reward), 1 when any had an infrastructure error, 2 for "
                                   "bad usage, 128+N when ended by signal N (SIGINT, SIGTERM, "
                                   "SIGHUP), after the summary of the episodes that finished.")
    p.add_argument("env", help="module or module:Name of an Environment")
    p.add_argument("-n", type=int, default=1, help="episodes (default 1)")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--concurrency", type=int, default=4, help="episodes at once (default 4)")
    p.add_argument("--agent", metavar="FILE", help="scripted agent: bash commands, one per "
                   "line, or JSON Lines of tool calls (default: the reference solution)")
    p.add_argument("--json", action="store_true", help="one JSON object per episode on stdout")
    p.add_argument("--out", metavar="FILE.jsonl", help="also write the JSON Lines to FILE")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="prove an environment: reference, null agent, attacks",
                       description="Exit status 1 if any check fails.")
    p.add_argument("env", help="module or module:Name of an Environment")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("redteam", help="attack an environment: the battery and your own agents",
                       description="Plays the null agent, then each attack of the battery "
                                   "(or those named with --attack) and each scripted agent "
                                   "given with --agent. An attack fails the environment when "
                                   "it scores more than the null agent (an agent given as "
                                   "FILE:MAX: more than MAX), the grader does not complete, "
                                   "or it leaves anything on the host. Exit status "
                                   "1 if any attack succeeds, 2 for bad usage.")
    p.add_argument("env", help="module or module:Name of an Environment")
    p.add_argument("--attack", action="append", metavar="NAME",
                   help="only this attack of the battery (repeatable; see --list)")
    p.add_argument("--agent", action="append", metavar="FILE[:MAX]",
                   help="also play this scripted agent as an attack (repeatable): bash "
                        "commands, one per line, or JSON Lines of tool calls. It fails the "
                        "environment when it scores more than the null agent, or more "
                        "than MAX if given: the partial credit that its honest part earns")
    p.add_argument("--list", action="store_true", help="list the battery's attacks and exit")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=cmd_redteam)

    image_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    if getattr(args, "n", 1) < 1 or getattr(args, "concurrency", 1) < 1:
        print("karotte: -n and --concurrency must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    from .. import lifecycle

    # SIGINT, SIGTERM and SIGHUP end every command the same way: every sandbox is
    # stopped, everything unwinds, what this process made is removed, 128 + the signal.
    lifecycle.install_signal_handlers()
    try:
        return args.func(args)
    except lifecycle.Terminated as exc:
        return lifecycle.terminated(exc, f"karotte {args.cmd}")


if __name__ == "__main__":
    sys.exit(main())
