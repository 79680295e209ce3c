"""The grader's side of grading: runs inside the grading sandbox, never in the trainer.

The host starts ``python3 -I`` in a fresh sandbox with this module, the environment's
code, /hidden and /submission (the vetted copy of the agent's deliverables), all
read-only, and fd 3: a private SOCK_SEQPACKET channel to the host. Programs the agent
wrote never run in this process: ctx.run() asks the host to run them in a sandbox of
their own, nested under the grader's cgroup, and the host measures them from outside.
The reward goes back over fd 3, which nothing but this process holds.

Standard library only: this runs under the system Python with nothing installed.
"""
from __future__ import annotations

import base64
import json
import math
import os
import socket
import statistics
import sys
import traceback
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from .results import ExecResult

CHANNEL_FD = 3
REPLY_SLACK = 256 * 1024  # a run reply's JSON and base64 around its output
# Every message on the channel, both ways, goes as SEQPACKET records of at most CHUNK
# bytes, the first byte of each saying whether more follow: one record cannot exceed the
# socket's send buffer (about 200 KiB by default), and a run's output alone may be 1 MiB,
# a run's stdin or a grader's details as large.
CHUNK = 64 * 1024
REQUEST_LIMIT = 64 * 1024 * 1024  # at most this much in one request or report
MORE, LAST = b"+", b"."
SUBMISSION = Path("/submission")
HIDDEN = Path("/hidden")
MiB = 1024 * 1024


class GraderError(Exception):
    """A request of the grader was refused (bad arguments, or the host failed)."""


@dataclass(frozen=True)
class SpeedComparison:
    """Candidate against baseline, each run in a fresh sandbox, interleaved, timed by the
    host. outputs[i] holds (candidate, baseline) stdout for inputs[i] (first run)."""

    candidate_seconds: float  # median wall time over every input and repeat
    baseline_seconds: float
    speedup: float  # baseline / candidate; inf if the candidate took no measurable time
    outputs: tuple[tuple[bytes, bytes], ...]
    failures: tuple[str, ...]  # runs that did not exit 0, timed out or were OOM-killed


def encode_result(result: ExecResult) -> dict:
    out = {f.name: getattr(result, f.name) for f in fields(ExecResult)}
    out["stdout"] = base64.b64encode(result.stdout).decode()
    out["stderr"] = base64.b64encode(result.stderr).decode()
    return out


def send_message(channel: socket.socket, data: bytes) -> None:
    """data as records of at most CHUNK bytes, tagged MORE or LAST."""
    for start in range(0, max(len(data), 1), CHUNK):
        end = start + CHUNK
        channel.send((LAST if end >= len(data) else MORE) + data[start:end])


def recv_message(channel: socket.socket, limit: int) -> bytes:
    """The other side of send_message: the whole message, at most `limit` bytes. Raises
    EOFError when the channel closed before a message began, GraderError if malformed."""
    parts: list[bytes] = []
    size = 0
    while True:
        record = channel.recv(CHUNK + 1)
        if not record:
            if not parts:
                raise EOFError("the grading channel is closed")
            raise GraderError("the grading channel closed within a message")
        size += len(record) - 1
        if size > limit or record[:1] not in (MORE, LAST):
            raise GraderError("malformed reply on the grading channel")
        parts.append(record[1:])
        if record[:1] == LAST:
            return b"".join(parts)


def decode_result(obj: dict) -> ExecResult:
    values = {f.name: obj[f.name] for f in fields(ExecResult)}
    values["stdout"] = base64.b64decode(obj["stdout"])
    values["stderr"] = base64.b64decode(obj["stderr"])
    return ExecResult(**values)


class GradeContext:
    """What grade(ctx) gets."""

    def __init__(self, seed: int, channel: socket.socket):
        self.seed = seed
        self.submission = SUBMISSION
        self.hidden = HIDDEN
        self._channel = channel

    def read_deliverable(self, path: str, limit: int = 1 * MiB) -> bytes | None:
        """The vetted bytes of a deliverable, or None if the agent did not make it.
        At most `limit` bytes (more raises GraderError: the answer is oversized)."""
        target = self.submission / path
        try:
            with open(target, "rb") as f:
                data = f.read(limit + 1)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        if len(data) > limit:
            raise GraderError(f"{path} is larger than {limit} bytes")
        return data

    def run(self, argv: Sequence[str], *, stdin: bytes | str = b"", timeout: float = 10.0,
            memory: int = 256 * MiB, pids: int = 64, cpus: float = 1.0,
            output_limit: int = 1 * MiB) -> ExecResult:
        """Run the agent's program in a fresh sandbox nested under this grader's cgroup,
        with the submission read-only at /workspace. Timed and measured by the host."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        reply = self._call({"op": "run", "argv": list(argv), "timeout": timeout,
                            "stdin": base64.b64encode(stdin).decode(), "memory": memory,
                            "pids": pids, "cpus": cpus, "output_limit": output_limit},
                           reply_limit=3 * output_limit + REPLY_SLACK)
        return decode_result(reply["result"])

    def compare_speed(self, candidate: Sequence[str], baseline: Sequence[str],
                      inputs: Sequence[bytes], *, repeats: int = 3, timeout: float = 30.0,
                      memory: int = 256 * MiB) -> SpeedComparison:
        """Time candidate against baseline fairly: every run in a fresh sandbox (no process
        of a run survives into the next), the two interleaved and alternating who goes
        first, repeated, medians of the host's wall clock."""
        if not inputs or repeats < 1:
            raise GraderError("compare_speed needs at least one input and one repeat")
        times: dict[str, list[float]] = {"candidate": [], "baseline": []}
        outputs: list[list[bytes]] = [[b"", b""] for _ in inputs]
        failures: list[str] = []
        for rep in range(repeats):
            for i, data in enumerate(inputs):
                order = [("candidate", candidate), ("baseline", baseline)]
                if (rep + i) % 2:
                    order.reverse()
                for which, argv in order:
                    r = self.run(argv, stdin=data, timeout=timeout, memory=memory)
                    if r.exit_code != 0 or r.timed_out or r.oom_killed:
                        failures.append(f"{which} on input {i}: exit {r.exit_code}, signal "
                                        f"{r.signal}, timed out {r.timed_out}, oom {r.oom_killed}")
                    times[which].append(r.wall_seconds)
                    if rep == 0:
                        outputs[i][0 if which == "candidate" else 1] = r.stdout
        cand = statistics.median(times["candidate"])
        base = statistics.median(times["baseline"])
        return SpeedComparison(cand, base, base / cand if cand > 0 else math.inf,
                               tuple((o[0], o[1]) for o in outputs), tuple(failures))

    def _call(self, request: dict, reply_limit: int) -> dict:
        send_message(self._channel, json.dumps(request).encode())
        try:
            reply = json.loads(recv_message(self._channel, reply_limit))
        except EOFError:
            raise GraderError("the host closed the grading channel") from None
        if "error" in reply:
            raise GraderError(reply["error"])
        return reply


def _finish(channel: socket.socket, message: dict[str, Any]) -> None:
    send_message(channel, json.dumps(message, allow_nan=True).encode())


def main() -> None:
    """python3 -I -S -c '...main()' TARGET SEED: grade, and report over fd 3."""
    target, seed = sys.argv[1], int(sys.argv[2])
    channel = socket.socket(fileno=CHANNEL_FD)
    os.set_inheritable(CHANNEL_FD, False)
    try:
        from .environment import Grade, load

        result = load(target)().grade(GradeContext(seed, channel))
        if isinstance(result, Grade):
            reward, details = result.reward, dict(result.details)
        else:
            reward, details = result, {}
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            _finish(channel, {"op": "invalid", "why": f"grade() returned {type(reward).__name__}, "
                              "not a number"})
            sys.exit(1)
        json.dumps(details)  # must be plain data; raises otherwise
        _finish(channel, {"op": "done", "reward": float(reward), "details": details})
    except BaseException:
        _finish(channel, {"op": "crashed", "traceback": traceback.format_exc()[-8000:]})
        raise
    # The verdict is sent: skip the interpreter's finalisation (a few ms per episode).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
