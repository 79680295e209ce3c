"""Reading and writing cgroup files, with errors that name the file, the errno and the fix;
walking, emptying and removing cgroup directories."""
from __future__ import annotations

import errno
import os
import signal
import time

from karotte.errors import CgroupError

_DELEGATE_FIX = (
    "run in a delegated cgroup, e.g. `systemd-run --user --scope -p Delegate=yes "
    "<command>`, or set KAROTTE_CGROUP_PARENT to a delegated cgroup")

_FIXES = {
    errno.EACCES: "Karotte needs write access to this cgroup: run as root, or " + _DELEGATE_FIX,
    errno.EPERM: "Karotte needs write access to this cgroup: run as root, or " + _DELEGATE_FIX,
    errno.ENOENT: "the file or cgroup is missing: the controller is not enabled here, "
                  "or the cgroup was removed",
    errno.ESRCH: "the process is gone",
    errno.EINVAL: "the kernel rejected the value; check it against the parent cgroup's limits",
    errno.EBUSY: "the cgroup is busy; its current usage or tasks prevent this change",
    errno.ENOSPC: "the parent cgroup's limits leave no room; raise them or use another parent",
    errno.EMFILE: "this process is out of file descriptors; raise RLIMIT_NOFILE (ulimit -n)",
    errno.ENFILE: "the host is out of file descriptors (fs.file-max)",
}


def _fail(action: str, path: str, err: OSError, fix: str | None = None) -> CgroupError:
    name = errno.errorcode.get(err.errno, str(err.errno))
    return CgroupError(f"{action} {path} failed: {name} ({os.strerror(err.errno)}); "
                       f"{fix or _FIXES.get(err.errno, 'see the kernel log')}")


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError as e:
        raise _fail("reading", path, e) from e


def _write(path: str, value: str, fix: str | None = None) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        raise _fail(f"opening to write {value!r}:", path, e, fix) from e
    try:
        os.write(fd, value.encode())
    except OSError as e:
        raise _fail(f"writing {value!r} to", path, e, fix) from e
    finally:
        os.close(fd)


def _read_fd(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)  # kernfs files show fresh contents from offset 0
    return os.read(fd, 65536).decode("ascii")


def _keyed(text: str) -> dict[str, int]:
    """'key value' lines (cgroup.events, memory.events, cpu.stat, oom_control) -> dict."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def _procs(directory: str) -> set[int]:
    """Tasks (tgids) in a cgroup directory and every cgroup below it."""
    found: set[int] = set()
    for top, dirs, _ in os.walk(directory):
        try:
            with open(os.path.join(top, "cgroup.procs"), encoding="ascii") as f:
                found.update(int(line) for line in f if line.strip())
        except FileNotFoundError:
            dirs.clear()  # removed while we walked
    return found


def _rmdir_tree(directory: str, deadline: float) -> None:
    """rmdir a cgroup and any child cgroups, deepest first. cgroupfs rmdir needs no files
    removed; EBUSY right after the last task died is retried until the deadline."""
    try:
        os.rmdir(directory)  # the usual case: no child cgroups, no walk of the control files
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    for top, _, _ in sorted(os.walk(directory), key=lambda w: -w[0].count("/")):
        delay = 0.001
        while True:
            try:
                os.rmdir(top)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise _fail("removing", top, e, "the cgroup still holds tasks or child "
                                "cgroups; call kill_all() first") from e
                time.sleep(delay)
                delay = min(delay * 2, 0.05)


def _describe_pids(pids) -> str:
    parts = []
    for pid in sorted(pids):
        try:
            stat = open(f"/proc/{pid}/stat", encoding="ascii", errors="replace").read()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            parts.append(f"{pid} ({comm}, state {stat[stat.rindex(')') + 2]})")
        except (OSError, ValueError):
            parts.append(str(pid))
    return ", ".join(parts)


def _sigkill_members(list_members, batch: int = 128) -> None:
    """SIGKILL every task that list_members() reports.

    Each pid is pinned with a pidfd first and signalled only if a second listing still
    shows it: a task that died and whose pid was recycled by a host process between the
    listing and the signal is never hit (the pidfd refers to the dead one: ESRCH).
    Batches bound the open fds whatever pids.max is.
    """
    # Never the trainer itself: on v1, while a thread of it spawns a sandbox in a
    # cgroup, cgroup.procs there (and above) lists the trainer's pid.
    listed = sorted(set(list_members()) - {os.getpid()})
    for start in range(0, len(listed), batch):
        pinned: dict[int, int] = {}
        try:
            for pid in listed[start:start + batch]:
                try:
                    pinned[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    pass
            still = list_members()
            for pid, fd in pinned.items():
                if pid in still:
                    try:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        finally:
            for fd in pinned.values():
                os.close(fd)

