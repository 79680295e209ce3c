"""karotte-sandbox: run commands in a fresh sandbox, open a shell, check the host, clean up.

Exit status of `exec`: the command's own; 128+N if it died of signal N; 124 if the
timeout hit; 125 if the sandbox could not be created (the cause is on stderr).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty

from .. import cgroups
from ..errors import KarotteError
from ..spec import Bind, SandboxSpec, parse_size

EXIT_TIMEOUT = 124
EXIT_SANDBOX_FAILED = 125
STDIN_LIMIT = 64 * 1024 * 1024


def _spec_from_args(args: argparse.Namespace) -> SandboxSpec:
    defaults = SandboxSpec()
    return SandboxSpec(
        memory=parse_size(args.memory) if args.memory else defaults.memory,
        pids=args.pids or defaults.pids,
        cpus=args.cpus or defaults.cpus,
        timeout=args.timeout or defaults.timeout,
        disk=parse_size(args.disk) if args.disk else defaults.disk,
        inodes=args.inodes or defaults.inodes,
        network=args.net,
        binds=tuple(Bind.parse(b) for b in args.bind),
    )


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    d = SandboxSpec()
    p.add_argument("--memory", metavar="SIZE", help=f"memory limit, tmpfs included, no swap "
                   f"(default {d.memory // 2**20}M)")
    p.add_argument("--pids", type=int, metavar="N", help=f"process limit (default {d.pids})")
    p.add_argument("--cpus", type=float, metavar="X", help=f"CPU bandwidth (default {d.cpus:g})")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help=f"wall-clock limit of the command (default {d.timeout:g})")
    p.add_argument("--disk", metavar="SIZE",
                   help=f"size of /workspace, also the file size limit (default {d.disk // 2**20}M)")
    p.add_argument("--inodes", type=int, metavar="N",
                   help=f"inode limit of /workspace (default {d.inodes})")
    p.add_argument("--net", choices=["none"], default="none",
                   help="network: none = a private network namespace with loopback only")
    p.add_argument("--bind", action="append", default=[], metavar="SRC:DST[:ro|rw]",
                   help="make a host path visible inside (read-only unless :rw); repeatable")


def _result_json(result) -> dict:
    out = dataclasses.asdict(result)
    out["stdout"] = result.stdout.decode("utf-8", errors="replace")
    out["stderr"] = result.stderr.decode("utf-8", errors="replace")
    return out


def _exit_status(result) -> int:
    if result.timed_out:
        return EXIT_TIMEOUT
    if result.signal is not None:
        return 128 + result.signal
    return result.exit_code


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
    try:
        spec = _spec_from_args(args)
        stdin = _read_stdin()
        sandbox = Sandbox(spec)
    except (KarotteError, OSError, ValueError) as exc:
        print(f"karotte-sandbox: cannot create the sandbox: {exc}", file=sys.stderr)
        return EXIT_SANDBOX_FAILED

    def stream(which: int, data: bytes) -> None:
        out = sys.stdout if which == 1 else sys.stderr
        out.buffer.write(data)
        out.flush()

    with sandbox:
        result = sandbox.exec(args.command, stdin=stdin,
                              on_output=None if args.json else stream)
    if args.json:
        print(json.dumps(_result_json(result)))
    else:
        if result.error:
            print(f"karotte-sandbox: {result.error}", file=sys.stderr)
        if result.timed_out:
            print(f"karotte-sandbox: timed out after {spec.timeout:g} s", file=sys.stderr)
        if result.oom_killed:
            print("karotte-sandbox: the memory limit was hit (OOM kill)", file=sys.stderr)
    return _exit_status(result)


def cmd_shell(args: argparse.Namespace) -> int:
    from ..sandbox import Sandbox

    try:
        spec = _spec_from_args(args)
        sandbox = Sandbox(dataclasses.replace(spec, timeout=args.timeout or 24 * 3600.0))
    except (KarotteError, OSError, ValueError) as exc:
        print(f"karotte-sandbox: cannot create the sandbox: {exc}", file=sys.stderr)
        return EXIT_SANDBOX_FAILED
    stdin_fd = sys.stdin.fileno()
    interactive = os.isatty(stdin_fd)
    env = {"TERM": os.environ.get("TERM", "xterm")}
    outcome = {}
    with sandbox:
        term = sandbox.open_terminal(args.command or ["/bin/bash", "-l"], env=env)
        if term.fd < 0:
            result = term.wait()
            print(f"karotte-sandbox: {result.error}", file=sys.stderr)
            return 127
        saved = None
        if interactive:
            term.resize(*termios.tcgetwinsize(stdin_fd))
            saved = termios.tcgetattr(stdin_fd)
            tty.setraw(stdin_fd, termios.TCSANOW)  # keep typed-ahead input
            signal.signal(signal.SIGWINCH,
                          lambda *_: term.resize(*termios.tcgetwinsize(stdin_fd)))
        wake_r, wake_w = os.pipe()

        def wait() -> None:
            try:
                outcome["result"] = term.wait()
            finally:
                os.write(wake_w, b"x")

        worker = threading.Thread(target=wait, daemon=True)
        worker.start()
        try:
            _relay(term.fd, stdin_fd, wake_r)
            worker.join()
        finally:
            if saved is not None:
                termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)
            term.close()
            os.close(wake_r)
            os.close(wake_w)
    result = outcome.get("result")
    return 1 if result is None else _exit_status(result)


def _relay(master: int, stdin_fd: int, wake_r: int) -> None:
    """Copy between our terminal and the sandbox's pty until the shell exits and its
    output is drained (or, with background jobs holding the pty, shortly after)."""
    stdout_fd = sys.stdout.fileno()
    watch = [master, stdin_fd, wake_r]
    ended = False
    while master in watch:
        poller = select.poll()
        for fd in watch:
            poller.register(fd, select.POLLIN)
        ready = [fd for fd, _ in poller.poll(100 if ended else None)]
        if not ready and ended:
            return
        if master in ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the last process on the pty closed it
                data = b""
            if data:
                os.write(stdout_fd, data)
            else:
                watch.remove(master)
        if stdin_fd in ready:
            data = os.read(stdin_fd, 65536)
            if data:
                os.write(master, data)
            else:
                watch.remove(stdin_fd)
        if wake_r in ready:
            watch.remove(wake_r)
            ended = True


def cmd_check(args: argparse.Namespace) -> int:
    from .. import probe

    report = probe.probe()
    print(probe.to_json(report) if args.json else probe.render_text(report))
    return 1 if report.missing_defaults else 0


def cmd_gc(args: argparse.Namespace) -> int:
    from .. import hostdirs

    work = [("cgroup", path, cgroups.remove_stale, "(and killed what was in it)")
            for path in cgroups.find_stale()]
    work += [("directory", path, shutil.rmtree, "") for path in hostdirs.find_stale()]
    if not work:
        print("nothing to clean up")
        return 0
    failed = 0
    for what, path, remove, note in work:
        if args.dry_run:
            print(f"would remove {what} {path}")
            continue
        try:
            remove(path)
            print(f"removed {what} {path} {note}".rstrip())
        except (KarotteError, OSError) as exc:
            failed += 1
            print(f"could not remove {what} {path}: {exc}", file=sys.stderr)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="karotte-sandbox",
        description="Run commands in a kernel-enforced Karotte sandbox (namespaces, seccomp, "
                    "cgroups), check what this host enforces, clean up after crashes.")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("exec", help="run a command in a fresh sandbox",
                       description="Run CMD in a fresh sandbox and remove it afterwards. Exit "
                                   "status: CMD's; 128+N if it died of signal N; 124 on timeout; "
                                   "125 if the sandbox could not be created.")
    _add_limit_options(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with the result (stdout and stderr included) "
                        "instead of streaming the output")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...")
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("shell", help="an interactive shell in a fresh sandbox (a real pty)")
    _add_limit_options(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...",
                   help="program to run instead of bash -l")
    p.set_defaults(func=cmd_shell)

    p = sub.add_parser("check", help="which protections this host enforces, and fixes for "
                                     "those it does not; exit 1 if a default one is missing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("gc", help="remove what crashed runs left behind (cgroups and the "
                                  "processes in them, private temporary directories)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.set_defaults(func=cmd_gc)
    return parser


def _exit_on_signal(signum, _frame):
    # SystemExit unwinds the `with sandbox` blocks: the sandbox is destroyed, not leaked.
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
