"""What grade(ctx) sees: GradeContext, the records of its runs, the channel's framing.

The grading process (karotte/grader_main.py) runs in a fresh sandbox with this module,
the environment's code, /hidden, /submission (the vetted copy of the agent's workspace)
and, on an image, /changes (the vetted diff of the agent's root), all read-only, and
fd 3: a private SOCK_SEQPACKET channel to the host.
Programs the agent wrote never run in that process: ctx.run() asks the host to run them
in a sandbox of their own, nested under the grader's cgroup, and the host measures them
from outside.

Standard library only, Python 3.9 and newer: this runs under the host's system Python
with nothing installed, or under a grader image's python3.
"""
from __future__ import annotations

import base64
import errno
import json
import math
import os
import posixpath
import re
import socket
import stat
import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

from .results import EgressRecord, ExecResult, IpRecord
from .spec import MiB

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
CHANGES = Path("/changes")


class GraderError(Exception):
    """A request of the grader was refused (bad arguments, or the host failed)."""


WORKSPACE = "/workspace"  # the submission, read-only, in the sandbox of a run
RUN_FILES = "/tests"  # where a run's `files` are, read-only
RUN_FILES_COUNT = 4096  # files in one run
RUN_FILES_BYTES = 32 * 1024 * 1024  # their contents together
RUN_PATH_BYTES, RUN_NAME_BYTES, RUN_DEPTH = 4096, 255, 32
RUN_ENV_BYTES = 64 * 1024  # a run's `env`, names and values together
RUN_OUTPUT_LIMIT = 16 * 1024 * 1024  # the most output_limit a run may ask for: the host
# holds both streams of every run of every grading at once
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Variables that make a program load code from a path or run a command it names: set by
# a grader to a directory of the submission (PYTHONPATH=/workspace puts the agent's
# unittest.py or json.py before the standard library, ENV-SHADOW-01; PATH=/workspace/bin
# its trojan python3, ENV-PATH-01), they hand the grader's own harness to the agent.
CODE_LOADING_ENV = ("LD_*", "PYTHON*", "PATH", "BASH_ENV", "ENV", "PERL5LIB", "PERL5OPT",
                    "PERLLIB", "RUBYLIB", "RUBYOPT", "NODE_OPTIONS", "NODE_PATH", "GCONV_PATH",
                    # the JVM, Lua, Ruby gems, R, Go, Tcl, Guile, git, OpenSSL
                    "CLASSPATH", "JAVA_TOOL_OPTIONS", "JDK_JAVA_OPTIONS", "_JAVA_OPTIONS",
                    "LUA_PATH*", "LUA_CPATH*", "LUA_INIT*", "GEM_PATH", "GEM_HOME", "R_LIBS*",
                    "R_PROFILE*", "R_ENVIRON*", "GOFLAGS", "TCLLIBPATH", "GUILE_LOAD_*",
                    "GIT_*", "OPENSSL_CONF", "OPENSSL_MODULES",
                    # where rc and config files are read from, and commands run by name
                    "HOME", "XDG_*", "SHELL", "PAGER", "EDITOR", "VISUAL")
# ... except these PYTHON* variables, which load nothing.
HARMLESS_ENV = ("PYTHONHASHSEED", "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONUNBUFFERED",
                "PYTHONDONTWRITEBYTECODE")


def _loads_code(name: str) -> bool:
    return name not in HARMLESS_ENV and any(
        name.startswith(p[:-1]) if p.endswith("*") else name == p for p in CODE_LOADING_ENV)


def _check_path(path: Any, what: str, absolute: bool) -> None:
    """A path in canonical form: no '..', no '.', no empty or over-long component."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise GraderError(f"{what} must be a non-empty string without NUL bytes: {path!r}")
    raw = path.encode("utf-8", "surrogateescape")
    parts = path.strip("/").split("/")
    if (path.startswith("/") != absolute or posixpath.normpath(path) != path
            or ".." in parts or "." in parts or len(raw) > RUN_PATH_BYTES or len(parts) > RUN_DEPTH
            or any(len(p.encode("utf-8", "surrogateescape")) > RUN_NAME_BYTES for p in parts)):
        kind = "an absolute" if absolute else "a relative"
        raise GraderError(f"{what} must be {kind} path in canonical form, with no '..', at "
                          f"most {RUN_DEPTH} components of {RUN_NAME_BYTES} bytes: {path!r}")


def check_run(files: Mapping[str, bytes], env: Mapping[str, str], cwd: str,
              allow_env: Collection[str]) -> None:
    """Refuse what a run must not be given; both the grader and the host check it, so
    that nothing a grader asks for can write outside the run's own directory or make
    the host hold unbounded data."""
    if len(files) > RUN_FILES_COUNT:
        raise GraderError(f"{len(files)} files for one run; at most {RUN_FILES_COUNT}")
    size = 0
    for path, data in files.items():
        _check_path(path, "a file's path", absolute=False)
        if not isinstance(data, bytes):
            raise GraderError(f"the content of {path!r} must be bytes or str")
        size += len(data)
    if size > RUN_FILES_BYTES:
        raise GraderError(f"the files of one run hold {size} bytes; at most {RUN_FILES_BYTES}")
    for path in files:
        parent = posixpath.dirname(path)
        while parent:
            if parent in files:
                raise GraderError(f"{parent!r} is a file and a directory of {path!r}")
            parent = posixpath.dirname(parent)
    _check_path(cwd, "cwd", absolute=True)
    size = 0
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise GraderError(f"not an environment variable name: {name!r}")
        if not isinstance(value, str) or "\0" in value:
            raise GraderError(f"the value of {name} must be a string without NUL bytes")
        if _loads_code(name) and name not in allow_env:
            raise GraderError(
                f"{name} makes programs load code from where it says: pointed at the "
                "submission, it runs the agent's files in place of your harness's (a "
                "json.py, a trojan python3). Add /workspace to sys.path after the standard "
                f"library inside your harness instead, or pass allow_env=[{name!r}] if "
                "what you run is the agent's program alone")
        size += len(name) + len(value.encode("utf-8", "surrogateescape")) + 2
    if size > RUN_ENV_BYTES:
        raise GraderError(f"the env of one run is {size} bytes; at most {RUN_ENV_BYTES}")


@dataclass(frozen=True)
class TimedRun:
    """One run that compare_speed timed, and whether it counts."""

    program: str  # "candidate" or "baseline"
    input: int  # index into compare_speed's inputs: each program ran once on each
    result: ExecResult  # as the host measured it: stdout, exit, wall time
    failure: str | None  # why the run does not count ("wrong output", "exit 1", ...), or None


@dataclass(frozen=True)
class SpeedComparison:
    """Candidate against baseline, each run in a fresh sandbox, interleaved, timed by the
    host, each input run once by each program. Every timed run's output has been
    checked: a speedup is only worth something when failures is empty."""

    candidate_seconds: float  # median wall time over every input
    baseline_seconds: float
    speedup: float  # baseline / candidate; inf if the candidate took no measurable time
    runs: tuple[TimedRun, ...]  # every run, candidate and baseline, in the order they ran
    failures: tuple[str, ...]  # one line per run that failed: error exit, signal, timeout,
    # OOM kill or wrong output ("candidate on input 1: wrong output")

    @property
    def ok(self) -> bool:
        """True when every run of both programs exited 0 with the right output."""
        return not self.failures


def same_stripped(output: bytes, expected: bytes) -> bool:
    """compare_speed's comparison: equal once whitespace at both ends is dropped."""
    return output.strip() == expected.strip()


def encode_result(result: ExecResult) -> dict:
    out = {f.name: getattr(result, f.name) for f in fields(ExecResult)}
    out["stdout"] = base64.b64encode(result.stdout).decode()
    out["stderr"] = base64.b64encode(result.stderr).decode()
    out["egress"] = result.egress.to_dict() if result.egress is not None else None
    out["egress_ip"] = result.egress_ip.to_dict() if result.egress_ip is not None else None
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
    if values["egress"] is not None:
        values["egress"] = EgressRecord.from_dict(values["egress"])
    if values["egress_ip"] is not None:
        values["egress_ip"] = IpRecord.from_dict(values["egress_ip"])
    return ExecResult(**values)


class GradeContext:
    """What grade(ctx) gets.

    seed: the environment's seed of the episode. submission: the vetted copy of the
    agent's /workspace. hidden: the environment's hidden files. changes: on an image, the
    vetted diff of the agent's root, a tree of the files and directories it made or
    changed outside /workspace at their absolute paths (/changes/etc/nginx/nginx.conf),
    with deleted, the paths of the image it deleted, and replaced, the directories it
    replaced whole; None on the host's userland. What is not there is the image's own.
    The diff is data here: the grader's own root is its image as it was (no .pth or
    program of the agent's runs in the grader); ctx.run runs on the image with the diff.
    """

    def __init__(self, seed: int, channel: socket.socket, changes: Path | None = None):
        self.seed = seed
        self.submission = SUBMISSION
        self.hidden = HIDDEN
        self.changes = changes
        self._channel = channel
        self._lists: dict | None = None

    @property
    def deleted(self) -> tuple[str, ...]:
        """The absolute paths of the agent's image that it deleted (() on the host's
        userland), as custody's records name paths (karotte/results.py's escape)."""
        return tuple(self._changes_lists()["deleted"])

    @property
    def replaced(self) -> tuple[str, ...]:
        """The directories of the image that the agent removed and made again: nothing of
        the image's is below them, only what ctx.changes holds."""
        return tuple(self._changes_lists()["replaced"])

    def _changes_lists(self) -> dict:
        if self.changes is None:
            return {"deleted": [], "replaced": []}
        if self._lists is None:  # asked for once: the lists can be long
            self._lists = self._call({"op": "changes"}, reply_limit=REQUEST_LIMIT)
        return self._lists

    def read_deliverable(self, path: str, limit: int = 1 * MiB) -> bytes | None:
        """The vetted bytes of a deliverable, or None if the agent did not make it. A
        relative path is under /workspace; an absolute one (on an image) is the agent's
        diff: the file as the agent left it, or None if it did not change or make it (a
        symlink there, or on the way, is not a file it made: None, never followed).
        At most `limit` bytes (more raises GraderError: the answer is oversized)."""
        if path.startswith("/"):
            if self.changes is None:
                raise GraderError(f"{path} is absolute: that is a path of the agent's image "
                                  "diff, and this episode ran on the host's userland")
            _check_path(path, "an absolute deliverable", absolute=True)
            target = self.changes / path[1:]
            try:
                if stat.S_ISCHR(os.lstat(target).st_mode):  # a whiteout: the agent deleted it
                    return None
            except (FileNotFoundError, NotADirectoryError):
                return None
        else:
            target = self.submission / path
        try:
            # O_NOFOLLOW, and /changes is nosymfollow for every component on the way
            with open(os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                data = f.read(limit + 1)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink: not a file the agent made
                return None
            raise
        if len(data) > limit:
            raise GraderError(f"{path} is larger than {limit} bytes")
        return data

    def run(self, argv: Sequence[str], *, stdin: bytes | str = b"",
            files: Mapping[str, bytes | str] | None = None, env: Mapping[str, str] | None = None,
            cwd: str = WORKSPACE, allow_env: Collection[str] = (), timeout: float = 10.0,
            memory: int = 256 * MiB, pids: int = 64, cpus: float = 1.0,
            output_limit: int = 1 * MiB, changes: bool = True,
            private_userland: bool = False) -> ExecResult:
        """Run the agent's program in a fresh sandbox nested under this grader's cgroup,
        with the submission read-only at /workspace. Timed and measured by the host.

        On an image the run's root is the agent's image with its vetted diff (changes):
        what the agent installed is there, what it deleted is gone, and every program of
        the image may be one the agent wrote, if it could write there (a root agent).
        changes=False runs on the image as it was, with the submission alone: for the
        grader's own tools (ctx.git does), which the agent must not have replaced.

        files: relative path -> content, placed read-only at /tests (RUN_FILES) in this
        run's sandbox alone, and gone after it: a hidden test runner, its inputs. The
        agent's program can read them while it runs, so put no expected value there that
        it must not see. env: variables added to the sandbox's own (PATH, HOME, ...);
        those that make a program load code from a path (CODE_LOADING_ENV) are refused
        unless named in allow_env. cwd: where argv starts (default /workspace).
        private_userland: run on a copy of the image's tree made for this run alone, so
        that nothing it leaves in the userland's page cache, futexes or inotify marks
        reaches another run or sandbox (LINK-CACHE-02, LINK-SIBLING-02); the environment
        must declare an image, and its memory= holds a copy into a tmpfs
        (docs/side-channels.md).
        """
        if isinstance(stdin, str):
            stdin = stdin.encode()
        placed = {path: data.encode() if isinstance(data, str) else bytes(data)
                  for path, data in (files or {}).items()}
        env = dict(env or {})
        check_run(placed, env, cwd, allow_env)
        reply = self._call({"op": "run", "argv": list(argv), "timeout": timeout,
                            "stdin": base64.b64encode(stdin).decode(), "memory": memory,
                            "pids": pids, "cpus": cpus, "output_limit": output_limit,
                            "files": {path: base64.b64encode(data).decode()
                                      for path, data in placed.items()},
                            "env": env, "cwd": cwd, "allow_env": sorted(allow_env),
                            "changes": bool(changes), "private_userland": private_userland},
                           reply_limit=3 * output_limit + REPLY_SLACK)
        return decode_result(reply["result"])

    def git(self, args: Sequence[str], *, repo: str = ".", timeout: float = 30.0,
            memory: int = 256 * MiB, output_limit: int = 1 * MiB) -> ExecResult:
        """git ARGS on the repository at /submission/REPO, in a sandbox of its own as
        ctx.run's, with none of the repository's own configuration.

        The agent owns the repository's .git: its config can name programs that git runs
        (core.fsmonitor, hooks, core.hooksPath, filter and diff drivers, a pager, gpg), and
        safe.directory, which would let git read that config, is not set (D13). git here
        gets a git dir of the grader's making, at /tests/git: the repository's HEAD,
        refs, packed-refs, index and shallow copied as data, a config that names nothing,
        no hooks, and the repository's objects read through an alternate. For commands
        that read (log, diff, show, status, rev-parse, ls-files): the run is read-only."""
        if repo != ".":  # the default: the submission itself is the work tree
            _check_path(repo, "repo", absolute=False)
        dot_git = self.submission / repo / ".git"
        if dot_git.is_symlink() or not dot_git.is_dir():
            raise GraderError(f"{repo} is not a git repository with a .git directory")
        inner = _inner_repository(self.submission / repo)
        if inner is not None:
            # ENV-BUILD-01: git runs a child git in each submodule (status, diff) with
            # GIT_DIR set to the submodule's own .git, which skips the ownership check
            # behind safe.directory: the child reads the agent's config there and runs
            # its core.fsmonitor, hooks and drivers in the grader's run.
            raise GraderError(
                f"{posixpath.join(repo, inner)} is a git repository inside {repo} (a "
                "submodule or an embedded repository): git would run the programs its "
                "config names, which the agent wrote, so ctx.git refuses a repository "
                "that holds one")
        worktree = posixpath.normpath(f"{WORKSPACE}/{repo}")
        files = _git_state(dot_git)
        files["git/objects/info/alternates"] = f"{worktree}/.git/objects\n".encode()
        env = {"GIT_DIR": f"{RUN_FILES}/git", "GIT_WORK_TREE": worktree,
               "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
               "GIT_ATTR_NOSYSTEM": "1", "GIT_NO_REPLACE_OBJECTS": "1",
               "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0", "GIT_PAGER": "cat"}
        # Karotte's own values, pointing at the grader's copy of the state, never the agent's
        # On the image as it was (changes=False): a root agent may have put a git of its
        # own at /usr/bin/git, which would tell whatever history it likes.
        return self.run(["/usr/bin/git", *args], files=files, cwd=worktree, timeout=timeout,
                        memory=memory, output_limit=output_limit, env=env, allow_env=list(env),
                        changes=False)

    def compare_speed(self, candidate: Sequence[str], baseline: Sequence[str],
                      inputs: Sequence[bytes], *, expected: Sequence[bytes | str] | None = None,
                      check: Callable[[int, bytes], bool] | None = None,
                      timeout: float = 30.0, memory: int = 256 * MiB,
                      output_limit: int = 1 * MiB,
                      private_userland: bool = False) -> SpeedComparison:
        """Time candidate against baseline fairly, and check the output of every run.

        Each program runs once on each input, every run in a fresh sandbox, so no process
        of a run survives into the next; the two programs are interleaved, alternating who
        goes first; the speeds are medians of the host's wall clock over all inputs.

        No input is run twice by one program. A fresh sandbox ends every process, but not
        what a run leaves in state the host shares between sandboxes: the page cache of
        the read-only /usr, for one, which a run can mark by reading pages and a later
        run can read back by timing reads. A program that saw an input before could
        answer it from such marks instead of computing (LINK-CACHE-01); one that never
        saw it has nothing to look up. So the inputs must be distinct: two that are the
        same, or the same apart from whitespace, are refused with a GraderError. For more
        timed runs pass more inputs, each drawn on its own, and give a check pass of your
        own (ctx.run) inputs that no timed run gets.

        The medians take every run, so every run's output is checked, not a sample: a
        program that can tell a checked run from a timed one (by the clock, the order of
        runs, anything) would otherwise print a wrong answer fast whenever only its speed
        counts. A run fails if it exits non-zero, is killed, times out, is OOM-killed,
        writes more than output_limit, or prints a wrong answer. What the right answer
        is, for the candidate and the baseline alike:

        - expected: one stdout per input, compared with whitespace at both ends dropped;
        - check(i, stdout) -> bool: your own test of an output on inputs[i], for answers
          that need a tolerance or have more than one right form;
        - neither (the default): the baseline is the oracle; the candidate's run on
          inputs[i] must print what the baseline's run on inputs[i] printed.

        There is no way to time runs whose output is not checked. Score nothing unless
        the result's failures is empty (result.ok).

        private_userland: every run, of both programs, on a copy of the image's tree of
        its own (ctx.run's option): no timed run reads what a check run, or another timed
        run, left in the userland, even on an input it saw before.
        """
        if not inputs:
            raise GraderError("compare_speed needs at least one input")
        if expected is not None and check is not None:
            raise GraderError("compare_speed takes expected or check, not both")
        inputs = [d.encode() if isinstance(d, str) else bytes(d) for d in inputs]
        _refuse_repeated(inputs)
        if expected is not None:
            if len(expected) != len(inputs):
                raise GraderError(f"compare_speed got {len(expected)} expected outputs for "
                                  f"{len(inputs)} inputs; pass one per input")
            check = _answers([e.encode() if isinstance(e, str) else bytes(e) for e in expected])
        done: list[tuple[str, int, ExecResult]] = []
        for i, data in enumerate(inputs):
            order = [("candidate", candidate), ("baseline", baseline)]
            if i % 2:
                order.reverse()
            for which, argv in order:
                done.append((which, i, self.run(argv, stdin=data, timeout=timeout,
                                                memory=memory, output_limit=output_limit,
                                                private_userland=private_userland)))
        if check is None:  # the baseline's run on each input is the oracle
            oracle = {i: r.stdout for which, i, r in done if which == "baseline"}
            check = _answers([oracle[i] for i in range(len(inputs))])
        runs = tuple(TimedRun(which, i, r,
                              _run_failure(r) or (None if check(i, r.stdout) else "wrong output"))
                     for which, i, r in done)
        cand = statistics.median(r.result.wall_seconds for r in runs if r.program == "candidate")
        base = statistics.median(r.result.wall_seconds for r in runs if r.program == "baseline")
        return SpeedComparison(cand, base, base / cand if cand > 0 else math.inf, runs,
                               tuple(f"{r.program} on input {r.input}: {r.failure}"
                                     for r in runs if r.failure))

    def _call(self, request: dict, reply_limit: int) -> dict:
        data = json.dumps(request).encode()
        if len(data) > REQUEST_LIMIT:
            raise GraderError(f"the request is {len(data)} bytes, over the channel's "
                              f"{REQUEST_LIMIT}: send less stdin or fewer files")
        send_message(self._channel, data)
        try:
            reply = json.loads(recv_message(self._channel, reply_limit))
        except EOFError:
            raise GraderError("the host closed the grading channel") from None
        if "error" in reply:
            raise GraderError(reply["error"])
        return reply


def _inner_repository(worktree: Path) -> str | None:
    """The first `.git` (a directory, or a gitfile naming one) below worktree's own,
    relative to worktree, or None."""
    for root, dirs, names in os.walk(worktree):
        if root == str(worktree):
            dirs[:] = [d for d in dirs if d != ".git"]
            continue
        if ".git" in dirs or ".git" in names:
            return str(Path(root, ".git").relative_to(worktree))
    return None


def _git_state(dot_git: Path) -> dict[str, bytes]:
    """What ctx.git copies of a repository's .git, as the files of a run: the data that
    says which commits are whose, and nothing that names a program to run. The object
    format is kept from the config (a sha256 repository reads only as one)."""
    files = {"git/refs/.keep": b""}  # git wants refs/, which is empty when all are packed
    for name in ("HEAD", "packed-refs", "index", "shallow", "info/exclude"):
        if (dot_git / name).is_file():
            files[f"git/{name}"] = (dot_git / name).read_bytes()
    for root, _, names in os.walk(dot_git / "refs"):
        for name in names:
            path = Path(root) / name
            files[f"git/{path.relative_to(dot_git)}"] = path.read_bytes()
    config = (dot_git / "config").read_bytes() if (dot_git / "config").is_file() else b""
    sha256 = re.search(rb"(?im)^\s*objectformat\s*=\s*sha256\s*$", config) is not None
    files["git/config"] = (b"[core]\n\trepositoryformatversion = 1\n\tbare = false\n"
                           b"[extensions]\n\tobjectformat = sha256\n" if sha256 else
                           b"[core]\n\trepositoryformatversion = 0\n\tbare = false\n")
    return files


def _refuse_repeated(inputs: Sequence[bytes]) -> None:
    """GraderError if two inputs are the same, or the same apart from whitespace: a run
    on the second could answer from what a run on the first left behind (LINK-CACHE-01)."""
    first: dict[tuple[bytes, ...], int] = {}
    for i, data in enumerate(inputs):
        j = first.setdefault(tuple(data.split()), i)
        if j != i:
            same = "the same" if data == inputs[j] else "the same apart from whitespace"
            raise GraderError(
                f"compare_speed got input {i} {same} as input {j}: each program runs once "
                "on each input, since a run could answer an input seen before from marks an "
                "earlier run left in host-shared state (the page cache); draw every input on "
                "its own, and pass more inputs for more timed runs")


def _answers(wanted: Sequence[bytes]) -> Callable[[int, bytes], bool]:
    """A compare_speed check: the output on inputs[i] is wanted[i], ends stripped."""
    return lambda i, output: same_stripped(output, wanted[i])


def _run_failure(r: ExecResult) -> str | None:
    """Why a timed run does not count, whatever it printed; None if it ended cleanly."""
    if r.timed_out:
        return "timed out"
    if r.oom_killed:
        return "out of memory"
    if r.signal is not None:
        return f"killed by signal {r.signal}"
    if r.exit_code != 0:
        return f"exit {r.exit_code}" + (f" ({r.error})" if r.error else "")
    if r.stdout_truncated:
        return "output over the limit"
    return None
