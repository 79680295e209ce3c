"""Grading in a second, fresh sandbox, and the agent's programs in sandboxes nested under it.

The grading sandbox shares no namespace with the agent's (that one is gone by now). It
sees, read-only: the grader's code (a private copy of the environment's package and of
Karotte's grader runtime) at /opt/karotte-lib, the hidden files at /hidden, the vetted
copy of the workspace at /submission and, on an image, the vetted diff of the agent's
root at /changes: data to read, never part of the grader's own root (a .pth file the
agent put in the image's site-packages would run in the grader), bound nosymfollow (a
symlink of the agent's would resolve in the grader's root, where /hidden is). The grader reports
over fd 3, a socket that only its own process holds; its stdout and stderr are logs,
never the verdict.

All of it sits under one cgroup P that holds no process itself: the grader's sandbox and
every run of the agent's program are children of P, so P's limits bound them together,
and each run has its own limits and is measured from outside.
"""
from __future__ import annotations

import base64
import json
import math
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from . import cgroups, hostdirs, private_tree
from .egress.policy import EgressConfigError, EgressPolicy, parse_policy
from .environment import Environment, Network, grader_image_of, grader_spec, target_of
from .errors import KarotteError
from .grader_runtime import (CHANGES, REQUEST_LIMIT, RUN_FILES, RUN_OUTPUT_LIMIT, WORKSPACE,
                             GraderError, check_run, encode_result, recv_message, send_message)
from .results import EgressRecord, ExecResult
from .sandbox import Sandbox
from .userns import sandbox_owner
from .spec import Bind, SandboxSpec
from .userland import hide_package

LIB_MOUNT = "/opt/karotte-lib"
PYTHON = "/usr/bin/python3"  # the grader's on the host's userland; on an image, the first tried
# ... then python3 on the image's PATH: karotte-init's execvp searches the command's PATH,
# which on an image is its config's Env (or Karotte's default PATH, for a dir: tree).
PYTHONS = (PYTHON, "python3")
MIN_PYTHON = (3, 9)  # the oldest Python the grader library runs under (tests/test_grader_library.py)
# The grader's entry: isolated mode (-I: no PYTHON* variables, no user site, no cwd on
# sys.path), no bytecode writes (-B), the private library copy first on sys.path. On the
# host's userland, no site module either (-S: no .pth file of the trainer's installs, none
# of its site-packages); on an image the site-packages are the image's own, which is what
# a grader image is for (pytest, numpy), and nothing of the agent's reaches that root.
HOST_FLAGS, IMAGE_FLAGS = ("-I", "-S", "-B"), ("-I", "-B")
BOOT = (f"import sys; sys.path[:0] = [{LIB_MOUNT!r}]; "
        "from karotte.grader_main import main; main()")
# The version is checked first, in code that every Python 3 parses (no f-string): an
# interpreter older than the library gets a line that names it, not a SyntaxError.
PREFLIGHT = ("import sys\n"
             f"if sys.version_info < {MIN_PYTHON!r}:\n"
             "    print('{\"python\": \"%d.%d.%d\", \"too_old\": true}' % sys.version_info[:3])\n"
             "    sys.exit(0)\n"
             f"sys.path[:0] = [{LIB_MOUNT!r}]\n"
             "from karotte.grader_main import preflight\n"
             "preflight()")
PREFLIGHT_SECONDS = 60.0  # at most, for importing the environment's module
# What the grading process imports of Karotte, and nothing more (tests/test_grader_library.py)
RUNTIME_MODULES = ("__init__.py", "environment.py", "spec.py", "results.py", "grader_runtime.py",
                   "grader_main.py", "protections.py", "imageref.py", "errors.py")
GRADER_LOG_LIMIT = 64 * 1024
GRADER_FAILURES = ("grader_crashed", "grader_timeout", "grader_out_of_memory", "invalid_reward",
                   "non_finite_reward")  # reasons that say the grader did not finish its job
TAIL_LINES, TAIL_CHARS = 20, 4096
WHY_LIMIT = 300  # characters of a grader's details["why"] that a report shows


@dataclass(frozen=True)
class GradeReport:
    """What the grading phase found. reason is "graded" when grade() returned a usable
    reward; anything else scores the bottom reward (the agent's submission made the
    grader fail), unless infra_error says the infrastructure did."""

    reward: float | None
    reason: str
    details: Mapping[str, Any] = field(default_factory=dict)
    log: str = ""  # the grader's stderr and stdout, capped
    infra_error: str | None = None
    runs: int = 0  # programs the grader ran through ctx.run
    # with Environment.grader_network: what those runs reached, in order (joined_egress)
    egress: EgressRecord | None = None


@dataclass(frozen=True)
class Changes:
    """The vetted diff of the agent's image (karotte/custody.py): the directory that holds
    it (SandboxSpec.changes of each ctx.run, /changes of the grader) and the absolute paths
    of the image that the agent deleted, or replaced whole (a directory it removed and
    made again: nothing of the image's is below it)."""

    tree: str
    deleted: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()


def private_dir(tag: str) -> str:
    """A fresh host directory only root and sandbox processes can read (owned by
    sandbox_owner(); mode 0750 as root, through the agent gid; unprivileged 0700, as
    sandboxes run as the caller): bind sources of hidden data and submissions."""
    path = hostdirs.new_dir(tag, 0o750 if os.geteuid() == 0 else 0o700)
    os.chown(path, *sandbox_owner())
    return path


def _copy_tree(src: Path, dst: Path) -> None:
    """Source files of a package: no bytecode, no native builds, no links."""
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "_bin", ".git")
                   and not os.path.islink(os.path.join(root, d))]
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            source = Path(root) / name
            if source.is_symlink() or name.endswith((".pyc", ".so")):
                continue
            shutil.copyfile(source, dst / rel / name)


@lru_cache(maxsize=None)
def grader_library(package: str) -> str:
    """A private copy of Karotte's grader runtime and of the environment's top-level
    package, made once per process: the grader imports from it, read-only."""
    lib = Path(private_dir("lib"))
    karotte_src = Path(__file__).parent
    (lib / "karotte").mkdir()
    for name in RUNTIME_MODULES:
        shutil.copyfile(karotte_src / name, lib / "karotte" / name)
    if package == "karotte":
        _copy_tree(karotte_src / "examples", lib / "karotte" / "examples")
    else:
        module = __import__(package)
        origin = Path(module.__file__)
        if origin.name == "__init__.py":
            _copy_tree(origin.parent, lib / package)
        else:
            shutil.copyfile(origin, lib / origin.name)
    # Bytecode made once here, by the grader's own interpreter from these very sources: the
    # grader runs with -B and a read-only library, so it would compile every module anew
    # in every grading (5 to 9 ms of each). A module that does not compile is left to the
    # preflight, which names it.
    subprocess.run([PYTHON, "-I", "-m", "compileall", "-q", str(lib)], stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=False)
    for root, dirs, files in os.walk(lib):
        for name in dirs + files:
            os.chown(os.path.join(root, name), *sandbox_owner())
    return str(lib)


def write_files(directory: str, files: Mapping[str, bytes | str]) -> None:
    """Write author-given files (relative paths, no '..') under directory."""
    root = Path(directory)
    for rel, content in files.items():
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts:
            raise ValueError(f"file path must be relative and inside: {rel!r}")
        target = root.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.encode() if isinstance(content, str) else content)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), *sandbox_owner())


def escape(text: str) -> str:
    """text with every control, format and separator character written as an escape
    (\\x1b, \\u202e): what the agent's programs printed cannot move a terminal's cursor,
    recolour it, reorder a line, or end one. Newlines too: call it on one line at a time."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def log_tail(log: str, lines: int = TAIL_LINES, limit: int = TAIL_CHARS) -> tuple[str, ...]:
    """The last `lines` lines of a grader's log, each escaped, at most `limit` characters
    together (the line at which the limit is reached keeps its start, which names the
    exception): bounded, and safe to print whatever the agent's program wrote into the
    grader's stderr."""
    kept: list[str] = []
    size = 0
    for line in reversed(log.rstrip("\n").splitlines()[-lines:]):
        line = escape(line)
        if size + len(line) > limit:
            kept.append(line[:limit - size] + "...")
            break
        kept.append(line)
        size += len(line)
    return tuple(reversed(kept))


def why_of(details: Mapping[str, Any]) -> str:
    """A grader's details["why"], escaped and capped, or "" when it gave none."""
    why = details.get("why")
    return escape(why)[:WHY_LIMIT] if isinstance(why, str) else ""


class GraderPreflightError(KarotteError):
    """The grader cannot import the environment: the author's to fix, never the agent's
    doing, so it is no score (an episode reports it as its infra_error)."""


@dataclass(frozen=True)
class GraderPython:
    """The interpreter that grades an environment, as its preflight found it."""

    path: str  # inside the grading sandbox: /usr/bin/python3, or the first on the image's PATH
    version: str  # its platform.python_version()
    image: str  # the grading sandbox's image ("host": the host's userland)

    def describe(self) -> str:
        where = "" if self.image == "host" else f" of the image {self.image}"
        return f"{self.path} {self.version}{where}"


# (target, grader image) -> its grader, or why it cannot import the environment
_preflights: dict[tuple[str, str], GraderPython | str] = {}
_preflight_lock = threading.Lock()


def preflight(env: Environment) -> GraderPython:
    """Import env's module in a sandbox exactly as its grader does (the grader image's
    python3 and flags, the private library copy), once per process and environment, and
    return that interpreter. Raises GraderPreflightError naming the cause: no python3 in
    the grader's image or one older than MIN_PYTHON, a module outside the standard library
    (and the image's), a construct that Python cannot parse, an error at import; or
    KarotteError, not remembered, if the sandbox itself failed (an image that cannot be
    imported, say)."""
    target = target_of(env)
    key = (target, grader_image_of(env))
    with _preflight_lock:
        if key not in _preflights:
            _preflights[key] = _import_as_grader(env, target)
        found = _preflights[key]
    if isinstance(found, str):
        raise GraderPreflightError(found)
    return found


def grader_flags(image: str) -> tuple[str, ...]:
    """The grader's interpreter options on image (HOST_FLAGS, IMAGE_FLAGS)."""
    return HOST_FLAGS if image == "host" else IMAGE_FLAGS


def _import_as_grader(env: Environment, target: str) -> GraderPython | str:
    limits = grader_spec(env)
    image = grader_image_of(env)
    lib = grader_library(target.split(".", 1)[0].split(":", 1)[0])
    spec = hide_package(replace(limits, binds=limits.binds + (Bind(lib, LIB_MOUNT),)), target)
    with Sandbox(spec) as sandbox:
        for python in PYTHONS:
            r = sandbox.exec([python, *grader_flags(image), "-c", PREFLIGHT, target],
                             timeout=min(limits.timeout, PREFLIGHT_SECONDS))
            if r.error is None:  # it started: this is the grader's python3
                break
        else:
            return _no_python(env, image)
    where = "" if image == "host" else f" of the image {image}"
    try:
        found = json.loads(r.stdout)
    except ValueError:
        found = None
    if r.timed_out:
        return f"the grader cannot import {target}: it took more than {r.wall_seconds:.0f} s"
    if not isinstance(found, dict) or r.exit_code != 0:
        tail = " | ".join(log_tail(r.stderr.decode("utf-8", "replace"), 5, 1000))
        return (f"the grader cannot import {target}: {python}{where} exited {r.exit_code}: "
                f"{tail} (the grader needs Python {_version(MIN_PYTHON)} or newer there)")
    grader = GraderPython(python, str(found.get("python", "")), image)
    if found.get("too_old"):
        return (f"the grader of {target} runs under {grader.describe()}, and needs Python "
                f"{_version(MIN_PYTHON)} or newer: set {type(env).__qualname__}.grader_image "
                f"to an image with a newer python3 (debian:bookworm+python3 has 3.11, "
                f"debian:bullseye+python3 3.9)")
    if "error" not in found:
        return grader
    at = (f"{found['file'].removeprefix(LIB_MOUNT + '/')}:{found['line']}: "
          if found.get("file") else "")
    why = f"the grader cannot import {target}: {at}{found['error']}: {found['message']}"
    if found["error"] == "SyntaxError":
        return (f"{why}. Graders run under {grader.describe()}, which cannot parse it: write "
                "what that Python takes, even where the trainer's Python is newer")
    if found["error"] in ("ModuleNotFoundError", "ImportError"):
        if image == "host":
            return (f"{why}. Graders run under {grader.describe()} -I -S, with the standard "
                    "library and a copy of the environment's own package only: import what "
                    "only the trainer needs inside the methods that run in the trainer, or "
                    "declare a grader_image that has it")
        return (f"{why}. Graders run under {grader.describe()} -I, with what that image has "
                "installed and a copy of the environment's own package: install the module "
                "in the grader's image, or import what only the trainer needs inside the "
                "methods that run in the trainer")
    return why


def _no_python(env: Environment, image: str) -> str:
    name = type(env).__qualname__
    where = "the host's userland" if image == "host" else f"the grader's image {image}"
    return (f"the grader of {target_of(env)} runs grade() under python3, and {where} has none "
            f"(neither {PYTHON} nor python3 on its PATH): install python3 "
            f"({_version(MIN_PYTHON)} or newer) "
            f"in the image (debian:SUITE+python3, `apt-get install python3`, `apk add python3`), "
            f"or set {name}.grader_image to an image that has it")


def _version(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def phase_policy(network: Network | None,
                 headers: Mapping[str, Mapping[str, str]] | None, what: str
                 ) -> EgressPolicy | str:
    """A phase's declared Network as the network of its sandboxes: "none" for None, else
    the EgressPolicy with each upstream's headers from the trainer's side, the variables
    of this process that headers_from_env names, then `headers` (upstream -> header ->
    value) over them. `what` names the declaration in errors (MyEnv.network)."""
    if network is None:
        return "none"
    upstreams = {}
    for name, url in network.upstreams.items():
        found = {}
        for header, var in network.headers_from_env.get(name, {}).items():
            if var not in os.environ:
                raise EgressConfigError(
                    f"{what}: the upstream {name!r} takes its {header} header from the "
                    f"variable {var}, which this process's environment does not have: set "
                    f"it (export {var}=...) or pass Episode(upstream_headers={{{name!r}: "
                    f"{{{header!r}: ...}}}})")
            found[header] = os.environ[var]
        found.update((headers or {}).get(name, {}))
        upstreams[name] = {"url": url, "headers": found}
    try:
        return parse_policy(network.allow, upstreams, mode=network.mode)
    except EgressConfigError as exc:
        raise EgressConfigError(f"{what}: {exc}") from None


RUN_REACHES = 200  # of the reaches of all of a grading's ctx.run a GradeReport holds


def joined_egress(records: list[EgressRecord]) -> EgressRecord | None:
    """The records of the grader's runs as one, in order, at most RUN_REACHES held."""
    if not records:
        return None
    reaches = tuple(r for record in records for r in record.reaches)
    return EgressRecord(reaches[:RUN_REACHES], sum(record.dropped for record in records)
                        + max(0, len(reaches) - RUN_REACHES))


def run_grader(env: Environment, seed: int, submission: str,
               changes: Changes | None = None,
               upstream_headers: Mapping[str, Mapping[str, str]] | None = None
               ) -> GradeReport:
    """Grade the vetted submission directory (and, on an image, the vetted diff) in a
    fresh sandbox. Never raises for what the submission does; raises KarotteError only if
    the host itself fails, and GraderPreflightError if the grader cannot import the
    environment (preflight). The grader's ctx.run get env.grader_network, with
    upstream_headers for its upstreams (phase_policy)."""
    network = phase_policy(env.grader_network, upstream_headers,
                           f"{type(env).__qualname__}.grader_network")
    grader = preflight(env)
    target = target_of(env)
    limits = grader_spec(env)
    lib = grader_library(target.split(".", 1)[0].split(":", 1)[0])
    hidden = private_dir("hidden")
    try:
        write_files(hidden, env.hidden_files(seed))
        parent = cgroups.create(
            cgroups.leaf_name("grade"),
            cgroups.CgroupLimits(memory=limits.memory, pids=limits.pids, cpus=limits.cpus))
        try:
            return _grade_in(parent, limits, grader, lib, hidden, submission, changes,
                             target, seed, env.image, network)
        finally:
            parent.destroy()
    finally:
        shutil.rmtree(hidden, ignore_errors=True)


def _grade_in(parent: cgroups.Cgroup, limits: SandboxSpec, grader: GraderPython, lib: str,
              hidden: str, submission: str, changes: Changes | None, target: str, seed: int,
              agent_image: str, network: EgressPolicy | str) -> GradeReport:
    binds = (Bind(lib, LIB_MOUNT), Bind(hidden, "/hidden"), Bind(submission, "/submission"))
    if changes is not None:
        # nosymfollow: a symlink of the agent's diff (/etc/x -> /hidden/expected.txt) would
        # resolve in this root, which holds /hidden; here no path through /changes follows
        # one (readlink shows it). In ctx.run's sandboxes it resolves in their own root.
        binds += (Bind(changes.tree, str(CHANGES), follow_symlinks=False),)
    spec = hide_package(replace(limits, binds=limits.binds + binds), target)
    deadline = time.monotonic() + limits.timeout
    host_end, grader_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    outcome: dict[str, Any] = {}
    reached: list[EgressRecord] = []  # of the grader's ctx.run, in order
    try:
        with Sandbox(spec, cgroup_parent=parent) as sandbox:
            def grade() -> None:
                try:
                    outcome["exec"] = sandbox.exec(
                        [grader.path, *grader_flags(grader.image), "-c", BOOT, target,
                         str(seed), *([str(CHANGES)] if changes is not None else [])],
                        timeout=limits.timeout, pass_fds=[grader_end.fileno()])
                except BaseException as exc:  # reported as an infrastructure failure
                    outcome["exec_error"] = exc
                finally:
                    grader_end.close()  # the grader holds the only other copy now

            worker = threading.Thread(target=grade, name="karotte-grader", daemon=True)
            worker.start()
            final, runs = _serve(host_end, parent, submission, changes, target, agent_image,
                                 network, deadline, reached)
            # A grader still waiting on the channel (its reply could not be sent) sees
            # EOF now and ends, instead of hanging until its timeout.
            host_end.shutdown(socket.SHUT_RDWR)
            worker.join()
    finally:
        host_end.close()
        if grader_end.fileno() >= 0:
            grader_end.close()
    if "exec_error" in outcome:
        raise KarotteError(f"the grading sandbox failed: {outcome['exec_error']}")
    return replace(_report(final, outcome["exec"], runs), egress=joined_egress(reached))


def _serve(channel: socket.socket, parent: cgroups.Cgroup, submission: str,
           changes: Changes | None, target: str, image: str, network: EgressPolicy | str,
           deadline: float, reached: list[EgressRecord]) -> tuple[dict | None, int]:
    """Answer the grader's requests (ctx.run, ctx.deleted) until it reports (or its
    channel closes); each run's egress record goes to `reached`."""
    runs = 0
    while True:
        try:
            request = json.loads(recv_message(channel, REQUEST_LIMIT))
            op = request["op"]
        except (OSError, EOFError):
            return None, runs
        except (GraderError, ValueError, KeyError, TypeError):
            return {"op": "invalid", "why": "malformed message on the grading channel"}, runs
        if op == "changes":
            reply = _changes_reply(changes)
        elif op == "run":
            runs += 1
            try:
                result = _run_nested(request, parent, submission, changes, target, image,
                                     network, deadline)
                if result.egress is not None:
                    reached.append(result.egress)
                reply = json.dumps({"result": encode_result(result)}).encode()
            except (KarotteError, GraderError, ValueError, TypeError, KeyError, OSError) as exc:
                reply = json.dumps({"error": f"run failed: {exc}"}).encode()
        else:
            return request, runs
        try:
            send_message(channel, reply)
        except OSError:
            return None, runs


def _changes_reply(changes: Changes | None) -> bytes:
    """ctx.deleted and ctx.replaced: the diff's lists, as long as the channel carries them."""
    if changes is None:
        why = ("the agent's sandbox ran on the host's userland: there is no diff of an image "
               "(ctx.changes is None)")
    else:
        data = json.dumps({"deleted": changes.deleted, "replaced": changes.replaced}).encode()
        if len(data) <= REQUEST_LIMIT:
            return data
        why = (f"the lists of deleted and replaced paths are {len(data)} bytes of JSON, over "
               f"the channel's {REQUEST_LIMIT}")
    return json.dumps({"error": why}).encode()


def _run_nested(request: dict, parent: cgroups.Cgroup, submission: str,
                changes: Changes | None, target: str, image: str, network: EgressPolicy | str,
                deadline: float) -> ExecResult:
    """One ctx.run: the agent's program in a fresh sandbox on the agent's image, with its
    vetted diff unless the grader asked for the image as it was (changes=False), and the
    grader's network (Environment.grader_network), whatever the request says."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ValueError("the grading time is used up")
    argv = [str(a) for a in request["argv"]]
    stdin = base64.b64decode(request["stdin"])
    with_changes = request.get("changes", True)
    if not isinstance(with_changes, bool):
        raise GraderError("changes must be true or false")
    files, env = request.get("files", {}), request.get("env", {})
    allow_env = request.get("allow_env", [])
    if not (isinstance(files, dict) and isinstance(env, dict) and isinstance(allow_env, list)):
        raise GraderError("files and env must be objects, allow_env a list")
    files = {path: base64.b64decode(data) for path, data in files.items()}
    cwd = request.get("cwd", WORKSPACE)
    # Again on this side: a grader's request must not write outside its run's directory
    # or make the host hold more than the bounds, whatever the grader sends.
    check_run(files, env, cwd, allow_env)
    output_limit = int(request["output_limit"])
    if not 0 < output_limit <= RUN_OUTPUT_LIMIT:  # REC-BOUND-01: the host holds it
        raise GraderError(f"output_limit {output_limit} is not within 1..{RUN_OUTPUT_LIMIT}")
    binds = (Bind(submission, WORKSPACE),)
    placed = private_dir("run") if files else None
    try:
        if placed:
            write_files(placed, files)
            binds += (Bind(placed, RUN_FILES),)
        spec = SandboxSpec(memory=int(request["memory"]), pids=int(request["pids"]),
                           cpus=float(request["cpus"]),
                           timeout=min(float(request["timeout"]), left),
                           output_limit=output_limit, binds=binds, image=image, network=network,
                           changes=changes.tree if changes and with_changes else None)
        # private_userland: the program's userland is a copy made for this run alone
        # (LINK-CACHE-02, LINK-SIBLING-02); the copy lost the image config's Env: pass it on.
        with private_tree.userland(image, request.get("private_userland", False), parent,
                                   spec.memory, left) as userland, \
                Sandbox(hide_package(replace(spec, image=userland.image), target),
                        cgroup_parent=parent) as run:
            start = time.monotonic()
            result = run.exec(argv, stdin=stdin, env={**userland.env, **env}, cwd=cwd)
            # Until the last byte of output, not the command's exit: a program that exits
            # at once and leaves a background process to finish and print the answer
            # (within the drain grace) must not get that work timed as free.
            return replace(result, wall_seconds=max(result.wall_seconds,
                                                    time.monotonic() - start))
    finally:
        if placed:
            shutil.rmtree(placed, ignore_errors=True)


def _report(final: dict | None, grader: ExecResult, runs: int) -> GradeReport:
    # stderr last: an interpreter that dies prints its traceback there, as it ends.
    log = (grader.stdout[-GRADER_LOG_LIMIT:] + grader.stderr[-GRADER_LOG_LIMIT:]).decode(
        "utf-8", errors="replace")
    if final is None:
        if grader.timed_out:
            return GradeReport(None, "grader_timeout", log=log, runs=runs)
        if grader.oom_killed:
            return GradeReport(None, "grader_out_of_memory", log=log, runs=runs)
        return GradeReport(None, "grader_crashed", log=log, runs=runs)
    op = final.get("op")
    if op == "crashed":
        # The traceback the grader sent over its channel goes last, so that the tail of the
        # log is what went wrong, whatever a process of the grader's printed after it.
        reported = ("[karotte: the grader's traceback, as it reported it]\n"
                    f"{final.get('traceback', '')}")
        return GradeReport(None, "grader_crashed", log=f"{log}\n{reported}" if log else reported,
                           runs=runs)
    if op != "done":
        return GradeReport(None, "invalid_reward", {"why": str(final.get("why", op))}, log, runs=runs)
    reward = final.get("reward")
    if not isinstance(reward, (int, float)) or isinstance(reward, bool):
        return GradeReport(None, "invalid_reward", log=log, runs=runs)
    if not math.isfinite(reward):
        return GradeReport(None, "non_finite_reward", {"reward": repr(reward)}, log, runs=runs)
    details = final.get("details") if isinstance(final.get("details"), dict) else {}
    return GradeReport(float(reward), "graded", details, log, runs=runs)
