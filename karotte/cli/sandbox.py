"""karotte-sandbox: run commands in a fresh sandbox, open a shell, check the host, clean up.

Exit status of `exec` and `shell`: the command's own; 128+N if it died of signal N; 124 if
the timeout hit; 125 if the sandbox could not be created or failed (the cause is on
stderr, or in the JSON object's "error"); 127 if the command could not be started (the
cause names the path); 129 if the terminal went away; 141 if stdout was a pipe whose
reader left.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import re
import select
import signal
import stat
import sys
import termios
import threading
import tty

from .. import __version__, gc, lifecycle
from ..egress.policy import EgressConfigError, parse_policy
from ..errors import KarotteError
from ..results import ExecResult
from ..spec import AGENT_USERS, Bind, BindError, SandboxSpec, SpecError, parse_size

EXIT_TIMEOUT = 124
EXIT_SANDBOX_FAILED = 125
EXIT_HANGUP = 128 + signal.SIGHUP
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
STDIN_LIMIT = 64 * 1024 * 1024
SHELL_TIMEOUT = 24 * 3600.0  # a shell's default: the session, not a command, is timed
# The limit options, as SandboxSpec fields: how the text of each becomes a value, and
# what the text must look like.
_SIZE = (parse_size, "a size, such as 4096, 64K, 512M or 1G")
_COUNT = (int, "a whole number")
_NUMBER = (float, "a number, such as 1, 0.5 or 30")
LIMITS = {"memory": _SIZE, "pids": _COUNT, "cpus": _NUMBER, "timeout": _NUMBER,
          "disk": _SIZE, "inodes": _COUNT}


def _host_cpus() -> int:
    """The CPUs this process may run on: what its sandboxes can use at most."""
    return len(os.sched_getaffinity(0))


def _spec_from_args(args: argparse.Namespace, timeout: float | None = None) -> SandboxSpec:
    """The spec the options ask for. Every value the user typed reaches SandboxSpec, 0
    and negative ones included, so its checks are the only ones; a refusal is reported
    with the option and the text as typed (ValueError)."""
    given = {}
    for name, (convert, form) in LIMITS.items():
        text = getattr(args, name)
        if text is None:
            continue
        try:
            given[name] = convert(text)
        except ValueError:
            raise ValueError(f"--{name} {text}: must be {form}") from None
    if timeout is not None and "timeout" not in given:
        given["timeout"] = timeout
    try:
        if args.net == "ip":
            network = parse_policy(args.allow, mode="ip")
        else:
            network = parse_policy(args.allow) if args.allow else args.net
    except EgressConfigError as exc:
        raise ValueError(f"--allow: {exc}") from None
    try:
        spec = SandboxSpec(network=network, binds=_binds(args), image=args.image,
                           agent_user=args.agent_user, **given)
    except SpecError as exc:
        if exc.field == "image":
            raise ValueError(f"--image {args.image}: must be {exc.requirement}") from None
        if exc.field not in LIMITS:
            raise
        raise ValueError(f"--{exc.field} {getattr(args, exc.field)}: must be "
                         f"{exc.requirement}") from None
    if spec.cpus > _host_cpus():
        # The cgroup would take the number, but no sandbox here gets more than the host
        # has: asking for more is a mistake to name, not a limit to pretend.
        raise ValueError(f"--cpus {args.cpus}: this host lets Karotte run on {_host_cpus()} "
                         f"CPUs, so at most {_host_cpus()} can be given")
    return spec


def _binds(args: argparse.Namespace) -> tuple[Bind, ...]:
    """--bind SRC:DST[:ro|rw], --ro-bind SRC DST and --rw-bind SRC DST. A relative SRC is
    taken from the current directory and DST is normalised ('/data/' is '/data')."""
    asked = [_split_bind(text) for text in args.bind]
    asked += [(src, dst, False) for src, dst in args.ro_bind]
    asked += [(src, dst, True) for src, dst in args.rw_bind]
    return tuple(Bind(os.path.abspath(src), os.path.normpath(dst) if dst.startswith("/") else dst,
                      writable) for src, dst, writable in asked)


def _split_bind(text: str) -> tuple[str, str, bool]:
    parts = text.split(":")
    mode = "ro"
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        mode = parts.pop()
    if len(parts) != 2 or not parts[0] or not parts[1]:
        raise BindError(f"--bind {text}: must be SRC:DST[:ro|rw]; for a path that holds ':' "
                        f"use --ro-bind SRC DST or --rw-bind SRC DST")
    return parts[0], parts[1], mode == "rw"


def _env_and_cwd(args: argparse.Namespace) -> tuple[dict[str, str], str | None]:
    env = {}
    for item in args.env:
        key, eq, value = item.partition("=")
        if not eq or not key or "\0" in item:
            raise ValueError(f"--env {item}: must be KEY=VALUE (without NUL bytes)")
        env[key] = value
    if args.cwd is not None and (not args.cwd.startswith("/") or "\0" in args.cwd):
        raise ValueError(f"--cwd {args.cwd}: must be an absolute path inside the sandbox")
    return env, args.cwd


def _add_limit_options(p: argparse.ArgumentParser, timeout_default: float) -> None:
    d = SandboxSpec()
    # argparse reads a word that starts with '-' as an option unless it is a plain
    # negative number: `--memory -5M` was "expected one argument", not the spec's own
    # refusal. Words like -5M count as values too.
    p._negative_number_matcher = re.compile(r"^-\.?\d")
    p.add_argument("--memory", metavar="SIZE", help=f"memory limit, tmpfs included, no swap "
                   f"(default {d.memory // 2**20}M)")
    p.add_argument("--pids", metavar="N", help=f"process limit (default {d.pids})")
    p.add_argument("--cpus", metavar="X",
                   help=f"CPU bandwidth, at most the CPUs of this host (default {d.cpus:g}); "
                        f"commands see OMP_NUM_THREADS, and so nproc, as X rounded up")
    p.add_argument("--timeout", metavar="SECONDS",
                   help=f"wall-clock limit of the command (default {timeout_default:g})")
    p.add_argument("--disk", metavar="SIZE",
                   help=f"size of /workspace, also the file size limit (default {d.disk // 2**20}M)")
    p.add_argument("--inodes", metavar="N",
                   help=f"inode limit of /workspace (default {d.inodes})")
    p.add_argument("--image", default="host", metavar="REF",
                   help="the root filesystem: host (the host's userland, the default), "
                        "dir:/TREE, oci:PATH[:TAG], oci-archive:FILE, docker-archive:FILE, "
                        "debian:SUITE[+PKG,...], or a name given at `karotte image import`; "
                        "imported into the image store on first use")
    p.add_argument("--agent-user", choices=AGENT_USERS, default="agent",
                   help="who runs the command: agent (uid 1000, no capabilities, the "
                        "default) or root (uid 0 of the sandbox's user namespace with only "
                        "the file-ownership capabilities, for package managers and chown)")
    p.add_argument("--net", choices=["none", "ip"], default="none",
                   help="network: none = a private network namespace with loopback only "
                        "(--allow adds the egress proxy); ip = a veth whose packets reach "
                        "only the --allow addresses and ports, TCP and UDP (root only)")
    p.add_argument("--allow", action="append", default=[], metavar="HOST[:PORT]",
                   help="reach HOST (NAME, *.SUFFIX, an IP address; ports 80 and 443 unless "
                        "given) through the host-side egress proxy, or with --net ip by "
                        "address (NAME resolved on the host at start, or an IP address); "
                        "repeatable (docs/egress.md)")
    p.add_argument("--bind", action="append", default=[], metavar="SRC:DST[:ro|rw]",
                   help="make a host path visible inside, read-only unless :rw; repeatable. "
                        "DST may be /workspace (the host directory replaces the workspace) "
                        "or a path of its own: not /, /proc, /dev or /sys, not onto or above "
                        "/usr, /etc, /tmp or /home/agent, not inside another bind. A rw bind "
                        "is the host's disk: outside --disk and --inodes (the file size limit "
                        "still holds); as root the agent writes it as a host uid of its "
                        "sandbox's own and the agent gid, which SRC must let write (`check` "
                        "prints it; docs/karotte-sandbox.md)")
    p.add_argument("--ro-bind", nargs=2, action="append", default=[], metavar=("SRC", "DST"),
                   help="as --bind SRC:DST:ro, for paths that hold ':'")
    p.add_argument("--rw-bind", nargs=2, action="append", default=[], metavar=("SRC", "DST"),
                   help="as --bind SRC:DST:rw, for paths that hold ':'")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set a variable in the command's environment; repeatable")
    p.add_argument("--cwd", metavar="DIR", help="the command's working directory "
                                                "(default: the image's WorkingDir, else "
                                                "/workspace)")


def _output_json(name: str, data: bytes) -> dict:
    """A stream as JSON without loss: `name` holds the text when the bytes are UTF-8,
    else null, and `name`_base64 then holds the bytes (null otherwise). A reader that
    knows only `name` sees null, never text that differs from what was written."""
    try:
        return {name: data.decode("utf-8"), f"{name}_base64": None}
    except UnicodeDecodeError:
        return {name: None, f"{name}_base64": base64.b64encode(data).decode("ascii")}


def _result_json(result: ExecResult) -> dict:
    out = dataclasses.asdict(result)
    # the exec's own record, bounded (docs/egress.md, "The record of each exec")
    out["egress"] = result.egress.to_dict() if result.egress is not None else None
    out["egress_ip"] = result.egress_ip.to_dict() if result.egress_ip is not None else None
    out.update(_output_json("stdout", result.stdout))
    out.update(_output_json("stderr", result.stderr))
    return out


def _failure_json(message: str) -> dict:
    """The object `exec --json` prints when there is no result: every key of one, null
    (nothing ran, nothing was measured), and the cause in "error"."""
    out = {f.name: None for f in dataclasses.fields(ExecResult)}
    out.update(stdout_base64=None, stderr_base64=None, error=message)
    return out


def _message(exc: BaseException) -> str:
    """What a user of the command line reads: the cause and the fix, no Python names."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return str(exc) or type(exc).__name__


def _exit_status(result: ExecResult) -> int:
    if result.timed_out:
        return EXIT_TIMEOUT
    if result.signal is not None:
        return 128 + result.signal
    return result.exit_code


def _say_why(result: ExecResult, timeout: float) -> None:
    """On stderr, why a command ended other than by exiting: it could not start, it
    timed out, it hit the memory limit."""
    if result.error:
        print(f"karotte-sandbox: {result.error}", file=sys.stderr)
    if result.timed_out:
        print(f"karotte-sandbox: timed out after {timeout:g} s", file=sys.stderr)
    if result.oom_killed:
        print("karotte-sandbox: the memory limit was hit (OOM kill)", file=sys.stderr)


def _stdout_gone() -> int:
    """Our stdout is a pipe whose reader left (`| head`): end quietly with the status of a
    program that SIGPIPE killed, and point stdout at /dev/null so that the interpreter's
    last flush cannot fail too."""
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


def _read_stdin() -> bytes:
    if sys.stdin is None or sys.stdin.isatty():
        return b""
    data = sys.stdin.buffer.read(STDIN_LIMIT + 1)
    if len(data) > STDIN_LIMIT:
        raise KarotteError(f"stdin is larger than {STDIN_LIMIT // 2**20} MiB; "
                           "bind a file into the sandbox instead (--bind)")
    return data


def cmd_exec(args: argparse.Namespace) -> int:
    from ..sandbox import Sandbox

    if not args.command:
        print("karotte-sandbox exec: no command given (usage: exec [OPTIONS] -- CMD...)",
              file=sys.stderr)
        return 2

    def failed(why: str) -> int:
        if args.json:
            print(json.dumps(_failure_json(why)))
        else:
            print(f"karotte-sandbox: {why}", file=sys.stderr)
        return EXIT_SANDBOX_FAILED

    try:
        spec = _spec_from_args(args)
        env, cwd = _env_and_cwd(args)
        stdin = _read_stdin()
        sandbox = Sandbox(spec)
    except (KarotteError, OSError, ValueError) as exc:
        return failed(f"cannot create the sandbox: {_message(exc)}")

    def stream(which: int, data: bytes) -> None:
        out = sys.stdout if which == 1 else sys.stderr
        out.buffer.write(data)  # the bytes as they came: binary output stays exact
        out.flush()

    try:
        with sandbox:
            result = sandbox.exec(args.command, stdin=stdin, env=env, cwd=cwd,
                                  on_output=None if args.json else stream)
        if args.json:
            print(json.dumps(_result_json(result)), flush=True)
    except BrokenPipeError:
        return _stdout_gone()
    except KarotteError as exc:  # the sandbox broke under the command
        return failed(f"the sandbox failed: {_message(exc)}")
    if not args.json:
        _say_why(result, spec.timeout)
    return _exit_status(result)


def cmd_shell(args: argparse.Namespace) -> int:
    from ..sandbox import Sandbox

    try:
        spec = _spec_from_args(args, timeout=SHELL_TIMEOUT)
        env, cwd = _env_and_cwd(args)
        sandbox = Sandbox(spec)
    except (KarotteError, OSError, ValueError) as exc:
        print(f"karotte-sandbox: cannot create the sandbox: {_message(exc)}", file=sys.stderr)
        return EXIT_SANDBOX_FAILED
    env = {"TERM": os.environ.get("TERM", "xterm"), **env}
    with sandbox:  # closed on every way out: the command's end, a hangup, a signal
        term = sandbox.open_terminal(args.command or ["/bin/bash", "-l"], env=env, cwd=cwd)
        if term.fd < 0:  # it could not start
            result, ended, failure = term.wait(), _ENDED, None
        else:
            result, ended, failure = _attend(sandbox, term, sys.stdin.fileno())
    if ended == _HANGUP:
        return EXIT_HANGUP  # no one is left to read a message
    if ended == _STDOUT_GONE:
        return _stdout_gone()
    if result is None:
        print(f"karotte-sandbox: the sandbox failed: {failure}", file=sys.stderr)
        return EXIT_SANDBOX_FAILED
    _say_why(result, spec.timeout)
    return _exit_status(result)


# Why the relay between our terminal and the sandbox's pty stopped.
_ENDED = "ended"  # the command exited and its output is drained
_HANGUP = "hangup"  # our terminal went away (a closed window, a dropped ssh session)
_STDOUT_GONE = "stdout gone"  # stdout is a pipe whose reader left


def _attend(sandbox, term, stdin_fd: int) -> tuple[ExecResult | None, str, str | None]:
    """Relay a terminal until its command ends or we cannot relay any more. Returns the
    command's result (None if the sandbox failed under it), why the relay stopped, and
    why the sandbox failed (or None).

    A thread waits for the command's exit report while this one relays. When the relay
    ends other than by the pty closing (a hangup, a closed stdout, a signal), a command
    still running is made to end (the sandbox is killed); the thread is joined before
    any fd it uses is closed."""
    interactive = os.isatty(stdin_fd)
    saved = None
    if interactive:
        term.resize(*termios.tcgetwinsize(stdin_fd))
        saved = termios.tcgetattr(stdin_fd)
        tty.setraw(stdin_fd, termios.TCSANOW)  # keep typed-ahead input
        signal.signal(signal.SIGWINCH, lambda *_: _follow_size(term, stdin_fd))
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC)
    outcome: dict = {}

    def wait() -> None:
        try:
            outcome["result"] = term.wait()
        except Exception as exc:  # the sandbox was killed under it: the relay reports
            outcome["error"] = _message(exc)
        finally:
            os.write(wake_w, b"x")  # wake_w is closed only after this thread is joined

    worker = threading.Thread(target=wait, name="karotte-shell-wait", daemon=True)
    worker.start()
    ended = None
    try:
        ended = _relay(term.fd, stdin_fd, wake_r, interactive)
    finally:
        if ended != _ENDED and worker.is_alive():
            sandbox.kill_all()  # no one is left to talk to the command: it must end now
        worker.join()
        if interactive:
            signal.signal(signal.SIGWINCH, signal.SIG_DFL)
            try:
                termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)
            except termios.error:  # EIO: the terminal hung up, nothing to restore
                _leave_hung_up_terminal(stdin_fd)
        term.close()
        os.close(wake_r)
        os.close(wake_w)
    return outcome.get("result"), ended, outcome.get("error")


def _leave_hung_up_terminal(tty_fd: int) -> None:
    """Point stdout and stderr at /dev/null where they are the terminal that hung up:
    every write to it fails now (EIO), and no one is left to read it."""
    terminal = os.fstat(tty_fd).st_rdev
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    for fd in (sys.stdout.fileno(), sys.stderr.fileno()):
        st = os.fstat(fd)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == terminal:
            os.dup2(devnull, fd)
    os.close(devnull)


def _follow_size(term, stdin_fd: int) -> None:
    try:
        term.resize(*termios.tcgetwinsize(stdin_fd))
    except (OSError, termios.error):
        pass  # the terminal or the pty is gone; the relay notices on its next read


def _relay(master: int, stdin_fd: int, wake_r: int, interactive: bool) -> str:
    """Copy between our terminal and the sandbox's pty until the command exits and its
    output is drained (or, with background jobs holding the pty, shortly after), or
    until our side cannot go on: why it stopped (_ENDED, _HANGUP, _STDOUT_GONE)."""
    stdout_fd = sys.stdout.fileno()
    watch = [master, stdin_fd, wake_r]
    ended = False
    while master in watch:
        poller = select.poll()
        for fd in watch:
            poller.register(fd, select.POLLIN)
        ready = [fd for fd, _ in poller.poll(100 if ended else None)]
        if not ready and ended:
            return _ENDED
        if master in ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the last process on the pty closed it
                data = b""
            if not data:
                watch.remove(master)
            elif not _write_all(stdout_fd, data):
                return _STDOUT_GONE if not interactive else _HANGUP
        if stdin_fd in ready:
            try:
                data = os.read(stdin_fd, 65536)
            except OSError:  # EIO: our terminal hung up
                data = b""
            if data:
                _write_all(master, data)
            elif interactive:
                return _HANGUP  # a raw terminal reads no EOF: it was hung up
            else:
                watch.remove(stdin_fd)
        if wake_r in ready:
            watch.remove(wake_r)
            ended = True
    return _ENDED


def _write_all(fd: int, data: bytes) -> bool:
    """Write all of data; False if the reader is gone (a closed pipe, a hung-up tty)."""
    try:
        while data:
            data = data[os.write(fd, data):]
    except (BrokenPipeError, OSError):
        return False
    return True


def cmd_check(args: argparse.Namespace) -> int:
    from .. import probe

    report = probe.probe()
    print(probe.to_json(report) if args.json else probe.render_text(report))
    return 1 if report.missing_defaults else 0


def cmd_gc(args: argparse.Namespace) -> int:
    leftovers = gc.find()
    if not leftovers:
        print("nothing to clean up")
        return 0
    failed = 0
    for leftover in leftovers:  # one at a time: each line as soon as its removal ends
        (done,) = gc.remove([leftover], dry_run=args.dry_run)
        # One leftover is one line: a cgroup is a directory in each hierarchy (memory,
        # pids, cpu, freezer, ...), removed together; an ip-mode sandbox's network is its
        # nft table and maybe its veth.
        cgroup = leftover.kind == gc.CGROUP
        what = f"{leftover.kind} {leftover.name if cgroup else ', '.join(leftover.paths)}"
        where = f" ({len(leftover.paths)} hierarchies)" if cgroup else ""
        if args.dry_run:
            print(f"would remove {what}{where}")
        elif done.removed:
            print(f"removed {what}{where}" + (" and killed what was in it" if cgroup else ""))
        else:
            failed += 1
            print(f"could not remove {what}: {_message(done.error)}", file=sys.stderr)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="karotte-sandbox",
        description="Run commands in a kernel-enforced Karotte sandbox (namespaces, seccomp, "
                    "cgroups), check what this host enforces, clean up after crashes.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("exec", help="run a command in a fresh sandbox",
                       description="Run CMD in a fresh sandbox and remove it afterwards. Exit "
                                   "status: CMD's; 128+N if it died of signal N; 124 on timeout; "
                                   "125 if the sandbox could not be created or failed; 127 if "
                                   "CMD could not be started.")
    _add_limit_options(p, SandboxSpec().timeout)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with the result instead of streaming the "
                        "output; stdout and stderr are text when they are UTF-8, else null "
                        "with the bytes in stdout_base64/stderr_base64; if there is no result, "
                        "every field is null and error says why (exit status 125)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...")
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("shell", help="an interactive shell in a fresh sandbox (a real pty)",
                       description="Run bash -l (or CMD) on a pty of a fresh sandbox, relayed "
                                   "to this terminal, and remove the sandbox afterwards. Exit "
                                   "status as for exec; 129 if this terminal went away.")
    _add_limit_options(p, SHELL_TIMEOUT)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...",
                   help="program to run instead of bash -l")
    p.set_defaults(func=cmd_shell)

    p = sub.add_parser("check", help="which protections this host enforces, and fixes for "
                                     "those it does not; exit 1 if a default one is missing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("gc", help="remove what crashed runs left behind (cgroups and the "
                                  "processes in them, private temporary directories)")
    p.add_argument("--dry-run", action="store_true",
                   help="only list what would be removed, one line for each")
    p.set_defaults(func=cmd_gc)
    return parser


def main(argv: list[str] | None = None) -> int:
    # SIGINT, SIGTERM and SIGHUP: the sandbox is stopped at once, the `with sandbox`
    # blocks unwind, what this process made is removed, and the exit status is 128 + N.
    lifecycle.install_signal_handlers()
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    try:
        return args.func(args)
    except lifecycle.Terminated as exc:
        return lifecycle.terminated(exc, "karotte-sandbox")


if __name__ == "__main__":
    sys.exit(main())
