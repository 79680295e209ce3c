"""Host probe: what this machine can enforce, and for what it cannot, why and the fix."""
from __future__ import annotations

import errno
from pathlib import Path


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def userns_blocker(err: int) -> str:
    """Why creating a user namespace failed with errno err, and how to fix it."""
    if _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        return ("unprivileged user namespaces are restricted by AppArmor "
                "(kernel.apparmor_restrict_unprivileged_userns=1); run as root, or set it to 0, "
                "or give this program an AppArmor profile with `userns,`")
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        return ("unprivileged user namespaces are disabled "
                "(kernel.unprivileged_userns_clone=0); run as root or set it to 1")
    if _read("/proc/sys/user/max_user_namespaces") == "0":
        return "user namespaces are disabled (user.max_user_namespaces=0); set it to e.g. 65536"
    if err in (errno.ENOSPC, errno.EUSERS):
        return ("the limit on nested or total user namespaces is reached "
                "(user.max_user_namespaces, or nesting depth 32); raise it or end other sandboxes")
    return ("the kernel refused to create a user namespace; if this runs in a container, its "
            "seccomp profile or missing privileges may block unshare/clone (e.g. Docker's default "
            "profile): run on the host, or with a profile that allows it")
