"""The grading process: loads the environment, calls grade(ctx), reports over fd 3.

karotte/grading.py starts it in a fresh sandbox as ``python3 -I -S -B -c BOOT TARGET
SEED [CHANGES]`` (on an image, its python3 without -S; CHANGES, where the agent's image
diff is, when there is one), with fd 3 a private SOCK_SEQPACKET channel to the host. The
reward goes back over that channel, which nothing but this process holds; stdout and
stderr are logs only.
The preflight imports the environment the same way and prints what failed.

Standard library only, Python 3.9 and newer: this runs under the host's system Python
with nothing installed, or under a grader image's python3.
"""
from __future__ import annotations

import json
import numbers
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

from .environment import Grade, load
from .grader_runtime import GradeContext, send_message

CHANNEL_FD = 3


def _finish(channel: socket.socket, message: dict[str, Any]) -> None:
    send_message(channel, json.dumps(message, allow_nan=True).encode())


def preflight() -> None:
    """python3 -I [-S] -c '...preflight()' TARGET: import the environment as main() does,
    and print on stdout, as JSON, this Python's version and what failed, if anything:
    the error, its message and the file and line of the author's code it points at."""
    found: dict[str, Any] = {"python": sys.version.split()[0]}  # platform.python_version()'s
    try:
        load(sys.argv[1])
    except BaseException as exc:
        found.update(error=type(exc).__name__, message=str(exc))
        if isinstance(exc, SyntaxError):
            found.update(message=exc.msg, file=exc.filename, line=exc.lineno)
        else:
            frames = [f for f in traceback.extract_tb(exc.__traceback__)
                      if not f.filename.startswith("<frozen")]
            found.update(file=frames[-1].filename, line=frames[-1].lineno)
    print(json.dumps(found))


def main() -> None:
    """python3 -I [-S] -c '...main()' TARGET SEED [CHANGES]: grade, and report over fd 3."""
    target, seed = sys.argv[1], int(sys.argv[2])
    changes = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    channel = socket.socket(fileno=CHANNEL_FD)
    os.set_inheritable(CHANNEL_FD, False)
    try:
        result = load(target)().grade(GradeContext(seed, channel, changes))
        if isinstance(result, Grade):
            reward, details = result.reward, dict(result.details)
        else:
            reward, details = result, {}
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            _finish(channel, {"op": "invalid", "why": f"grade() returned {type(reward).__name__}, "
                              "not a number"})
            sys.exit(1)
        json.dumps(details)  # must be plain data; raises otherwise
        _finish(channel, {"op": "done", "reward": float(reward), "details": details})
    except BaseException:
        # Each line cut to its start: an exception's message can quote megabytes of the
        # agent's output, and the line that names the exception must survive the cut.
        lines = traceback.format_exc().splitlines(keepends=True)
        report = "".join(line if len(line) <= 1000 else line[:1000] + "...\n" for line in lines)
        _finish(channel, {"op": "crashed", "traceback": report[-8000:]})
        # The host puts this traceback at the end of the grader's log; printed on stderr
        # as well, it would be there twice. (Were the channel gone, _finish raises, and
        # the interpreter prints both.)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # The verdict is sent: skip the interpreter's finalisation (a few ms per episode).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
