"""The agent's tool calls: the argv each runs in the sandbox, and what the model is told.

The bash tool runs each command in a fresh bash that restores the shell state the last
one saved (its working directory and exports); read_file is cat, write_file /bin/sh
writing stdin, both with the agent's rights and nothing more. karotte/episode.py decides
when a call runs (the budget); this module, how.
"""
from __future__ import annotations

import io
import tarfile
import time
from dataclasses import dataclass
from typing import Mapping

from .environment import File
from .results import EgressRecord, ExecResult, IpRecord

SHELL_STATE = "/home/agent/.karotte-shell-state"
# Each command runs in a fresh bash that first restores the previous command's working
# directory and exported variables, and saves them again on exit. No long-lived shell:
# a timeout kills one command's process group and nothing else, and no output marker
# exists that the agent could print to confuse the parser.
SHELL = r"""
if [ -r %(state)s ]; then . %(state)s; fi
__karotte_save() {
    export -n SHLVL _ OLDPWD 2>/dev/null  # this shell is ending: only the saved list changes
    { export -p; printf 'cd -- %%q 2>/dev/null\n' "$PWD"; } > %(state)s 2>/dev/null
}
trap __karotte_save EXIT
eval "$1"
""" % {"state": SHELL_STATE}
UNTAR = ["tar", "-x", "--no-same-owner", "-m", "-C", "/workspace", "-f", "-"]
# What the tools run on an image, checked at reset, so that an image without one fails
# there, named, and not at the agent's first call: the bash tool /bin/bash (no /bin/sh
# fallback: the shell state above is bash's, and agents write bash), write_file /bin/sh,
# read_file cat, placing the task's files tar. The host's userland has them all. Each is
# looked for in PATH as the exec does (`command -v` would also find a shell's builtins).
IMAGE_TOOLS = ["/bin/sh", "-c", "[ -x /bin/bash ] || echo /bin/bash; for t in cat tar; do "
               'f=; IFS=:; for d in $PATH; do [ -x "$d/$t" ] && f=1; done; unset IFS; '
               '[ -n "$f" ] || echo "$t"; done; true']
TRUNCATED = "\n[karotte: output truncated, only the first {limit} bytes of {stream} are shown]\n"
MAX_ARGUMENT = 128 * 1024 - 1  # MAX_ARG_STRLEN: the kernel's limit on one argv string


@dataclass(frozen=True)
class ToolResult:
    """One tool call as the agent sees it (text) and as the trainer logs it."""

    text: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    wall_seconds: float
    egress: EgressRecord | None = None  # what the call reached (ExecResult.egress)
    egress_ip: IpRecord | None = None  # in the ip mode (ExecResult.egress_ip)


def render(result: ExecResult, limit: int, timeout: float) -> str:
    text = result.stdout.decode("utf-8", errors="replace")
    if result.stdout_truncated:
        text += TRUNCATED.format(limit=limit, stream="stdout")
    err = result.stderr.decode("utf-8", errors="replace")
    if result.stderr_truncated:
        err += TRUNCATED.format(limit=limit, stream="stderr")
    if err:
        text += err
    if result.timed_out:
        text += f"\n[karotte: the command timed out after {timeout:g} s and was killed]\n"
    elif result.signal is not None:
        text += f"\n[karotte: the command was killed by signal {result.signal}]\n"
    if result.oom_killed:
        text += "[karotte: the memory limit was reached]\n"
    return text


def tarball(files: Mapping[str, bytes | str | File]) -> bytes:
    """The workspace files (checked by check_files) as a tar archive for UNTAR."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content in files.items():
            f = content if isinstance(content, File) else File(content)
            data = f.data()
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), f.mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def bash_argv(command: str) -> list[str]:
    """The agent's bash tool: one command run in the persistent shell state."""
    return ["/bin/bash", "--noprofile", "--norc", "-c", SHELL, "bash", command]


@dataclass(frozen=True)
class ToolCall:
    """A tool call that may run: what to run, and whether the wall budget cut its time."""

    tool: str
    argument: str
    argv: list[str]
    stdin: bytes | str
    timeout: float
    cut_by_budget: bool


def tool_argv(tool: str, argument: str) -> list[str] | str:
    """The argv that runs a tool call, or why no process can take the argument (a NUL
    byte, over the kernel's 128 KiB for one argument, text that is not valid): the
    model is told why, and nothing runs."""
    what = "command" if tool == "bash" else "path"
    try:
        size = len(argument.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        return f"the {what} is not valid text (it has a lone surrogate); nothing was run"
    if "\0" in argument:
        why = f"the {what} contains a NUL byte, which no program can take as an argument"
    elif size > MAX_ARGUMENT:
        why = (f"the {what} is {size} bytes, over the limit of {MAX_ARGUMENT}; "
               "write long content to a file with write_file")
    else:
        return {"bash": bash_argv(argument),
                "read_file": ["cat", "--", argument],
                "write_file": ["/bin/sh", "-c", 'cat > "$1"', "sh", argument]}[tool]
    return f"{why}; nothing was run"
