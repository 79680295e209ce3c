"""Directories Karotte makes on the host: where they go, and finding those of dead creators.

Each is named like a sandbox cgroup, after its creator (karotte-<pid>.<starttime>-...), so
`karotte-sandbox gc` can remove what a crashed process left behind, and the process's own
exit (karotte/lifecycle.py) what it leaves itself.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from . import names
from .shutdown import refuse_if_ending


def runtime_dir() -> str:
    """$KAROTTE_RUNTIME_DIR, else /dev/shm (a tmpfs: the custody copy creates many small
    files, at memory speed), else the temp directory."""
    return os.environ.get("KAROTTE_RUNTIME_DIR") or (
        "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


def new_dir(tag: str, mode: int) -> str:
    """A fresh directory in runtime_dir() named after this process."""
    refuse_if_ending(f"a {tag} directory")
    path = os.path.join(runtime_dir(), names.leaf_name(tag))
    os.mkdir(path, mode)
    os.chmod(path, mode)  # not narrowed by the umask
    return path


def find_stale() -> list[str]:
    """Directories of runtime_dir() made by processes that are gone."""
    return _matching(lambda name: not names.creator_alive(name))


def find_created_by() -> list[str]:
    """Directories of runtime_dir() made by this process (its pid and start time)."""
    mine = f"{names.PREFIX}{os.getpid()}."
    return _matching(lambda name: name.startswith(mine) and names.creator_alive(name))


def remove_created_by() -> None:
    """Remove this process's directories: at exit by itself (lifecycle.cleanup also calls
    it, after destroying the sandboxes that use them), in whichever process made one."""
    for path in find_created_by():
        shutil.rmtree(path, ignore_errors=True)


atexit.register(remove_created_by)  # runs after lifecycle.cleanup: registered before it


def _matching(keep) -> list[str]:
    """Directories of runtime_dir() with a leaf_name() name that keep(name) accepts."""
    top = runtime_dir()
    found = []
    for name in sorted(os.listdir(top)):
        try:
            if keep(name):
                found.append(os.path.join(top, name))
        except ValueError:  # not one of ours
            continue
    return found
