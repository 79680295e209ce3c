"""Verdicts: the evidence turned into one Protection per line of `karotte-sandbox check`.

A line is enforced only when the evidence shows it in force; otherwise it says why not
and the fix, or which other line's cause kept it from being tested.
"""
from __future__ import annotations

import errno
import os
from typing import Callable

from .. import cgroups, steps
from ..mounts import WORKSPACE, default_rootfs
from ..protections import CGROUP_LINES, NAMESPACES, PROTECTIONS
from ..spec import MiB
from ..steps import MOUNT_SETATTR_KERNEL
from ..userns import AGENT_UID, DEFAULT_UID_BASE
from .evidence import (CLONE3_KERNEL, CLONE_INTO_CGROUP_KERNEL, HIDDEN, IMAGE_TREE, PIDFD_KERNEL,
                       PROBE_SPEC, _KILL_FILES, _account, _Evidence, _Failure, _Host, _mount_fields,
                       _read_or_none)
from .report import Protection

_BUG = "this is a bug in Karotte, not in the host: report it with `karotte-sandbox check --json`"


def _errname(err: int) -> str:
    return errno.errorcode.get(err, str(err)) if err else "success"


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n} bytes"


# What a namespace line reads inside the agent's own namespace: (what it shows, in force,
# why not).
_Seen = tuple[str, bool, str | None]


class _HostCheck:
    """One run of `check`: the host's facts and the probe sandbox's evidence, and the
    verdicts that turn them into lines (VERDICTS below says which verdict makes which)."""

    def __init__(self, host: _Host, run: _Evidence | _Failure):
        self.host = host
        self.run = run
        self.ev = run if isinstance(run, _Evidence) else None
        self.inside = self.ev.inside if self.ev else None

    def line(self, name: str, ok: bool, how: str, why_not: str | None = None,
             fix: str | None = None) -> Protection:
        if ok:
            return Protection(name, True, PROTECTIONS[name], how)
        return Protection(name, False, PROTECTIONS[name], how, why_not or "not in force",
                          fix or _BUG)

    def untested(self, name: str, how: str) -> Protection | None:
        """The line for a protection the sandbox must show, if it could not."""
        failure = self.run if isinstance(self.run, _Failure) else None
        if self.ev is not None and name in CGROUP_LINES:
            failure = self.ev.cgroup_failure
        if failure is not None:
            if name in failure.causes:
                return self.line(name, False, how, *failure.causes[name])
            return self.line(name, False, how,
                             f"untested: no sandbox could be created on this host (the cause "
                             f"is on the {failure.first} line)",
                             f"fix {failure.first} first, then run `karotte-sandbox check` again")
        if self.inside is None and name not in CGROUP_LINES + ("pidfd", "clone3"):
            names = list(steps.step(self.ev.inside_step).protections)
            if names and name not in names:
                return self.line(name, False, how, f"untested: the agent's command could not "
                                 f"start (the cause is on the {names[0]} line)",
                                 f"fix {names[0]} first")
            return self.line(name, False, how,
                             f"the in-sandbox probe failed: {self.ev.inside_error}",
                             steps.fix(names[0]) if names else _BUG)
        return None

    # -- namespaces

    def namespace(self, name: str, seen: Callable[[_HostCheck], _Seen]) -> Protection:
        ns = NAMESPACES[name]
        how = f"own {ns} namespace (clone3 CLONE_NEW{ns.upper().replace('MNT', 'NS')})"
        missing = self.untested(name, how)
        if missing:
            return missing
        inside, host = self.inside["ns"][ns], self.host.own_ns[ns]
        if inside == host:
            return self.line(name, False, how, f"the agent shares the caller's {ns} "
                             f"namespace ({host})")
        extra, ok, why = seen(self)
        how = f"own {ns} namespace ({inside}, the caller's is {host})" + (f"; {extra}" if extra
                                                                       else "")
        return self.line(name, ok, how, why)

    def user_ns(self) -> _Seen:
        return f"uid_map inside: {self.inside['uid_map']}", True, None

    def pid_ns(self) -> _Seen:
        procs, comm = self.inside["procs"], self.inside["init_comm"]
        # An agent that shares init's host uid sees /proc with hidepid=2: init is hidden
        # from it, but is there (kill(1, 0) reaches it).
        hidden = comm is None and 1 not in procs and self.inside.get("signal_init") == 0
        ok = (comm == "karotte-init" or hidden) and set(procs) <= {1, self.inside["pid"]}
        init = "hidden from the agent (hidepid=2)" if hidden else comm
        return (f"the agent sees {len(procs)} processes, PID 1 is {init}", ok,
                f"the agent sees processes {procs[:10]} and PID 1 is {comm!r}")

    def mnt_ns(self) -> _Seen:
        mounts = [_mount_fields(line) for line in self.inside["mountinfo"]]
        root = next((m for m in mounts if m[0] == "/"), None)
        visible = self.inside["visible"]
        no_nosuid = [point for point, opts, _ in mounts if "nosuid" not in opts]
        problems = []
        if root is None or "ro" not in root[1]:
            problems.append("the root is writable")
        if visible:
            problems.append(f"host paths are visible: {', '.join(visible)}")
        if no_nosuid:
            problems.append(f"mounts without nosuid: {', '.join(no_nosuid)}")
        hidden = [p for p in HIDDEN if os.path.lexists(p)]
        return (f"read-only {root[2] if root else '?'} root, every mount nosuid, host "
                f"{', '.join(hidden)} not visible", not problems, "; ".join(problems))

    def net_ns(self) -> _Seen:
        devs = self.inside["netdevs"]
        return (f"interfaces: {', '.join(devs)}", devs == ["lo"],
                f"the agent sees the interfaces {', '.join(devs)}, not only lo")

    def ipc_ns(self) -> _Seen:
        return "", True, None

    def uts_ns(self) -> _Seen:
        name = self.inside["hostname"]
        return (f"hostname {name}", name == self.ev.spec.hostname,
                f"the hostname is {name!r}, not {self.ev.spec.hostname!r}")

    def cgroup_ns(self) -> _Seen:
        paths = sorted(set(self.inside["cgroups"]))
        return ("/proc/self/cgroup shows / in every hierarchy", paths == ["/"],
                f"the agent sees cgroup paths {', '.join(paths)}")

    # -- the agent's process

    def seccomp(self, name: str) -> Protection:
        how = "seccomp filter on every command (karotte.seccomp.DEFAULT_POLICY)"
        missing = self.untested(name, how)
        if missing:
            return missing
        mode = self.inside["status"].get("Seccomp", "").strip()
        want = {"unshare(CLONE_NEWUSER)": errno.EPERM,
                "personality(ADDR_NO_RANDOMIZE)": errno.EPERM, "clone3": errno.ENOSYS}
        got = self.inside["syscalls"]
        calls = ", ".join(f"{label} -> {_errname(got[label])}" for label in got)
        wrong = [f"{label} -> {_errname(got[label])}, not {_errname(want[label])}"
                 for label in got if got[label] != want[label]]
        if mode != "2" or wrong:
            return self.line(name, False, how, "; ".join(
                [f"Seccomp: {mode or '?'} in /proc/self/status"] + wrong))
        return self.line(name, True, f"filter mode (Seccomp: 2); {calls}")

    def no_new_privs(self, name: str) -> Protection:
        how = "prctl(PR_SET_NO_NEW_PRIVS) before exec"
        missing = self.untested(name, how)
        if missing:
            return missing
        value = self.inside["status"].get("NoNewPrivs", "").strip()
        return self.line(name, value == "1", "NoNewPrivs: 1 in /proc/self/status",
                         f"NoNewPrivs: {value or '?'}")

    def capabilities(self, name: str) -> Protection:
        how = "bounding set and ambient caps dropped, then setresuid to a non-zero uid"
        missing = self.untested(name, how)
        if missing:
            return missing
        caps = {k: self.inside["status"].get(k, "?").strip()
                for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
        held = {k: v for k, v in caps.items() if set(v) != {"0"}}
        return self.line(name, not held,
                         "CapInh, CapPrm, CapEff, CapBnd and CapAmb all 0",
                         "the agent holds capabilities: " + ", ".join(f"{k} {v}" for k, v in
                                                                     held.items()))

    def _ids(self) -> tuple[list[str], list[str], str]:
        status = self.inside["status"]
        return (status.get("Uid", "").split(), status.get("Gid", "").split(),
                status.get("Groups", "").strip())

    def agent_uid(self, name: str) -> Protection:
        how = f"setresuid/setresgid {AGENT_UID} inside, no supplementary groups"
        missing = self.untested(name, how)
        if missing:
            return missing
        uids, gids, groups = self._ids()
        want = [str(AGENT_UID)] * 4
        host_uid = self.ev.agent_host_uid
        if host_uid is None:
            return self.line(name, False, how, self.ev.inside_error or "the agent's file was "
                             "not measured from the host", _BUG)
        if uids != want or gids != want or groups not in ("", str(AGENT_UID)):
            return self.line(name, False, how,
                             f"the agent has Uid {' '.join(uids)}, Gid {' '.join(gids)}, "
                             f"Groups {groups or '-'}")
        if host_uid == 0:
            return self.line(name, False, how,
                             "files the agent writes belong to host root (uid 0)",
                             f"check KAROTTE_UID_BASE; {_BUG}")
        gid = self.ev.agent_host_gid
        if host_uid == self.host.euid:
            where = f"uid {host_uid}, the caller's own (see separate-host-uid)"
            binds = "writable binds (rw) are written as the caller too"
        else:
            where = f"uid {host_uid} ({host_uid:#x}), {_account(host_uid)}"
            binds = (f"so do files it writes through a writable bind (rw), whose source must "
                     f"let group {gid} write (chgrp {gid}; chmod g+rwxs)")
        return self.line(name, True,
                         f"uid and gid {AGENT_UID} inside, no groups; on the host the agent's "
                         f"files belong to {where}, group {gid}; {binds}")

    def separate_host_uid(self, name: str) -> Protection:
        how = (f"as root, the sandbox's ids map to host {DEFAULT_UID_BASE:#x}.. "
               f"(KAROTTE_UID_BASE), and the agent is a host uid of its own per sandbox, from "
               f"{DEFAULT_UID_BASE + 65536:#x}..")
        host_uid = self.ev.agent_host_uid if self.ev else None
        if not self.host.root:
            seen = ""
            if host_uid is not None:
                seen = f" (measured: the agent's files belong to host uid {host_uid})"
            if self.inside and self.inside.get("signal_init") == 0:
                seen += ("; inside, the agent is also the same kernel uid as the sandbox's "
                         "init (kill(1, 0) succeeds)")
            return self.line(
                name, False, how,
                f"running as uid {self.host.euid}: an unprivileged caller can map only its own "
                f"uid, so the agent runs as host uid {self.host.euid}, the caller's own{seen}; "
                f"code that escaped the sandbox could reach every file and process of that uid",
                "run Karotte as root (the agent then gets a host uid that no account owns), or "
                "as a dedicated account that owns nothing else")
        missing = self.untested(name, how)
        if missing:
            return missing
        if host_uid is None:
            return self.line(name, False, how, self.ev.inside_error or "the agent's file was "
                             "not measured from the host", _BUG)
        if host_uid in (0, self.host.euid):
            return self.line(name, False, how, f"the agent's files belong to host uid {host_uid}")
        return self.line(name, True, f"the agent's host uid {host_uid} ({host_uid:#x}) is not "
                         f"the caller's ({self.host.euid}) and is {_account(host_uid)}")

    def own_userns_owner(self, name: str) -> Protection:
        how = ("as root, each sandbox's user namespace is created by a host uid of its own, "
               "and the agent runs as it, so per-user kernel counts made inside (inotify "
               "instances, message-queue bytes, queued signals, epoll watches, pipe buffers, "
               "fds in flight) are charged to it, not to the caller or other sandboxes")
        owner = self.ev.userns_owner if self.ev else None
        if not self.host.root:
            return self.line(
                name, False, how,
                f"running as uid {self.host.euid}: only the caller can create the sandbox's user "
                f"namespace, so what an agent takes of the per-user pools (inotify instances, "
                f"message queues, queued signals) is taken from uid {self.host.euid}'s; each "
                f"sandbox is capped, but many together can fill them",
                "run Karotte as root, or as a dedicated account whose per-user pools nothing "
                "else needs")
        missing = self.untested(name, how)
        if missing:
            return missing
        if owner is None:
            return self.line(name, False, how, "NS_GET_OWNER_UID on init's user namespace failed")
        if owner in (0, self.host.euid):
            return self.line(name, False, how, f"the sandbox's user namespace is owned by host "
                             f"uid {owner}, the caller's")
        agent = self.ev.agent_host_uid
        if agent != owner:
            return self.line(name, False, how, f"the agent's files belong to host uid {agent}, "
                             f"not to the namespace's owner {owner}: per-uid counts of all "
                             f"sandboxes are pooled")
        return self.line(name, True, f"the sandbox's user namespace is owned by host uid "
                         f"{owner} ({owner:#x}), the agent's own, not the caller's "
                         f"({self.host.euid}); that uid is {_account(owner)}")

    def new_session(self, name: str) -> Protection:
        how = "setsid() before exec: no controlling tty shared with the host"
        missing = self.untested(name, how)
        if missing:
            return missing
        sid, pid = self.inside["sid"], self.inside["pid"]
        return self.line(name, sid == pid, f"the agent's command leads its own session "
                         f"(sid {sid} = its pid)", f"the agent is in session {sid}, not its own "
                         f"({pid})")

    def closed_fds(self, name: str) -> Protection:
        how = "close_range(3, ~0) before exec"
        missing = self.untested(name, how)
        if missing:
            return missing
        extra = {fd: target for fd, target in self.inside["fds"].items() if int(fd) > 2}
        return self.line(name, not extra, "the agent's command starts with fds 0-2 only",
                         "the agent inherits fds " + ", ".join(f"{fd} ({t})" for fd, t in
                                                              sorted(extra.items())))

    def rlimits(self, name: str) -> Protection:
        spec = self.ev.spec if self.ev else PROBE_SPEC
        how = "setrlimit before exec: RLIMIT_FSIZE = disk, RLIMIT_NOFILE = nofile, RLIMIT_CORE = 0"
        missing = self.untested(name, how)
        if missing:
            return missing
        got = {k: tuple(v) for k, v in self.inside["rlimits"].items()}
        want = {"RLIMIT_FSIZE": (spec.disk, spec.disk), "RLIMIT_NOFILE": (spec.nofile,
                                                                          spec.nofile),
                "RLIMIT_CORE": (0, 0)}
        wrong = [f"{k} is {got.get(k)}, asked {v}" for k, v in want.items() if got.get(k) != v]
        return self.line(name, not wrong,
                         f"RLIMIT_FSIZE {_size(spec.disk)}, RLIMIT_NOFILE {spec.nofile}, "
                         f"RLIMIT_CORE 0 (soft = hard, read back inside)", "; ".join(wrong))

    def disk_quota(self, name: str) -> Protection:
        spec = self.ev.spec if self.ev else PROBE_SPEC
        how = ("every writable place of Karotte's is its own tmpfs with size= and nr_inodes=; "
               "a writable bind (rw) is the host's filesystem, outside it")
        missing = self.untested(name, how)
        if missing:
            return missing
        vfs = self.inside["statvfs"]
        devices = {f"/dev/{d}" for d in default_rootfs().devices}
        problems, places = [], []
        for point, opts, fstype in (_mount_fields(line) for line in self.inside["mountinfo"]):
            if "ro" in opts or fstype in ("proc", "devpts") or point in devices:
                continue
            size, inodes = vfs.get(point, (0, 0))
            if fstype != "tmpfs" or not size or not inodes:
                problems.append(f"{point} is a writable {fstype} without a size and inode limit")
            else:
                places.append(f"{point} {_size(size)}")
        ws = vfs.get(WORKSPACE, (0, 0))
        if tuple(ws) != (spec.disk, spec.inodes):
            problems.append(f"{WORKSPACE} holds {_size(ws[0])} and {ws[1]} inodes, asked "
                            f"{_size(spec.disk)} and {spec.inodes}")
        return self.line(name, not problems,
                         f"{WORKSPACE} tmpfs {_size(ws[0])}, {ws[1]} inodes (statvfs inside); "
                         f"writable: {', '.join(places)}; a writable bind (rw) is outside "
                         f"this quota: only RLIMIT_FSIZE caps each of its files",
                         "; ".join(problems))

    # -- cgroups, read from the host

    def cgroup(self, name: str, files: dict[int, str],
               limit: Callable[[_HostCheck, str, str], Protection]) -> Protection:
        """files: what enforces the line, by cgroup version; limit: the verdict on what the
        host read from them."""
        version = (self.ev and self.ev.cgroup_version) or self.host.cgroup_version
        how = (f"cgroup v{version} {files[version]}" if version else
               f"cgroup v1 {files[1]}, or v2 {files[2]}")
        missing = self.untested(name, how)
        if missing:
            return missing
        return limit(self, name, how)

    def _placed(self) -> str | None:
        if self.ev.unplaced:
            return f"init is not in {', '.join(self.ev.unplaced)}"
        return None

    def cgroup_memory(self, name: str, how: str) -> Protection:
        spec, lim = self.ev.spec, self.ev.limits
        key = "memory.limit_in_bytes" if self.ev.cgroup_version == 1 else "memory.max"
        value = lim.get(key)
        if value != str(spec.memory) or self._placed():
            return self.line(name, False, how, self._placed() or
                             f"{key} is {value or 'missing'}, asked {spec.memory}")
        return self.line(name, True, f"cgroup v{self.ev.cgroup_version} {key} = "
                         f"{_size(spec.memory)} as asked (read on the host); init is in the "
                         f"cgroup")

    def cgroup_swap(self, name: str, how: str) -> Protection:
        spec, lim = self.ev.spec, self.ev.limits
        if self.ev.cgroup_version == 1:
            key, want = "memory.memsw.limit_in_bytes", str(spec.memory)
            what = "= the memory limit: memory + swap may not exceed memory, so no swap"
            fix = ("boot with swapaccount=1 (cgroup v1 needs it for memory.memsw.*), or turn "
                   "swap off")
        else:
            key, want, what = "memory.swap.max", "0", "= 0"
            fix = "enable swap accounting (CONFIG_MEMCG_SWAP, no swapaccount=0), or turn swap off"
        value = lim.get(key)
        if value != want:
            swap = (_read_or_none("/proc/swaps") or "").splitlines()[1:]
            now = ("; swap is on now" if swap
                   else "; no swap is active now, so nothing is swapped today")
            return self.line(name, False, how,
                             f"{key} is {value or 'missing'}: the memory cgroup cannot forbid "
                             f"swap{now}", fix)
        return self.line(name, True, f"cgroup v{self.ev.cgroup_version} {key} {what}")

    def cgroup_pids(self, name: str, how: str) -> Protection:
        value = self.ev.limits.get("pids.max")
        if value != str(self.ev.spec.pids) or self._placed():
            return self.line(name, False, how, self._placed() or
                             f"pids.max is {value or 'missing'}, asked {self.ev.spec.pids}")
        return self.line(name, True, f"cgroup v{self.ev.cgroup_version} pids.max = "
                         f"{self.ev.spec.pids} as asked (read on the host)")

    def cgroup_cpu(self, name: str, how: str) -> Protection:
        lim, spec = self.ev.limits, self.ev.spec
        # the quota the sandbox asked for, by the same formula it wrote it with
        quota = cgroups.CgroupLimits(memory=spec.memory, pids=spec.pids, cpus=spec.cpus).quota_us
        if self.ev.cgroup_version == 1:
            got = f"{lim.get('cpu.cfs_quota_us')} {lim.get('cpu.cfs_period_us')}"
            key = "cpu.cfs_quota_us cpu.cfs_period_us"
        else:
            got, key = lim.get("cpu.max", "None"), "cpu.max"
        want = f"{quota} {cgroups.PERIOD_US}"
        if got != want or self._placed():
            return self.line(name, False, how, self._placed() or
                             f"{key} is {got}, asked {want}")
        return self.line(name, True, f"cgroup v{self.ev.cgroup_version} {key} = {want} "
                         f"({spec.cpus:g} CPU, read on the host)")

    def cgroup_kill(self, name: str, how: str) -> Protection:
        ev = self.ev
        if ev.cgroup_version == 1:
            ok_files = "freezer.state" in ev.kill_files
            mech = "freezer.state FROZEN, SIGKILL by pidfd, thaw"
        else:
            ok_files = bool({"cgroup.kill", "cgroup.freeze"} & set(ev.kill_files))
            mech = ("cgroup.kill" if "cgroup.kill" in ev.kill_files
                    else "cgroup.freeze, SIGKILL by pidfd")
        if ev.kill_error or not ok_files or ev.kill_after != 0 or (ev.kill_before or 0) < 2:
            why = ev.kill_error or (
                f"no {' or '.join(_KILL_FILES)} in the sandbox's cgroup" if not ok_files else
                f"{ev.kill_after} of {ev.kill_before} tasks were left after kill_all()")
            return self.line(name, False, how, why)
        return self.line(name, True, f"cgroup v{ev.cgroup_version} {mech}: init and a "
                         f"background process ({ev.kill_before} tasks) killed, cgroup empty")

    # -- kernel interfaces the native layer needs

    def _refused(self, name: str, how: str, call: str, err: int,
                 need: tuple[int, int]) -> Protection:
        """The line for a kernel interface this process cannot use."""
        version = ".".join(map(str, need))
        cause = f"{call} fails with {errno.errorcode.get(err, err)} here"
        if self.host.version < need:
            return self.line(name, False, how, f"{cause}: kernel {self.host.kernel} is older "
                             f"than {version}", f"upgrade the kernel to {version} or later")
        return self.line(name, False, how,
                         f"{cause}, though kernel {self.host.kernel} has it (Linux {version}+): a "
                         f"seccomp profile or LSM around this process denies it, as container "
                         f"runtimes' default profiles do",
                         f"run Karotte on the host, or in a container whose seccomp profile "
                         f"allows {call}")

    def mount_setattr(self, name: str) -> Protection:
        how = "mount_setattr makes host binds read-only, nosuid, nodev"
        err = self.host.mount_setattr_errno
        if err in (errno.ENOSYS, errno.EPERM):
            return self._refused(name, how, "mount_setattr", err, MOUNT_SETATTR_KERNEL)
        missing = self.untested(name, how)
        if missing:
            return missing
        devices = {f"/dev/{d}" for d in default_rootfs().devices}
        bad = []
        binds = 0
        for point, opts, fstype in (_mount_fields(line) for line in self.inside["mountinfo"]):
            if fstype in ("tmpfs", "proc", "devpts"):
                continue
            binds += 1
            want = {"nosuid"} if point in devices else {"ro", "nosuid", "nodev"}
            if not want <= opts:
                bad.append(f"{point} lacks {','.join(sorted(want - opts))}")
        if bad:
            return self.line(name, False, how, "; ".join(bad))
        return self.line(name, True, f"kernel {self.host.kernel}: all {binds} host "
                         f"binds are ro,nosuid,nodev (device nodes nosuid), as mountinfo "
                         f"shows inside")

    def pidfd(self, name: str) -> Protection:
        how = "init and cgroup tasks are signalled by pidfd, never by a recycled pid"
        if self.host.pidfd_errno:
            return self._refused(name, how, "pidfd_open", self.host.pidfd_errno, PIDFD_KERNEL)
        missing = self.untested(name, how)
        if missing:
            return missing
        if self.ev.init_pidfd_errno:
            return self.line(name, False, how, f"pidfd_open(init) fails with "
                             f"{errno.errorcode.get(self.ev.init_pidfd_errno)}")
        return self.line(name, True, "pidfd_open works; init was spawned with CLONE_PIDFD "
                         "and is held by a pidfd")

    def clone3(self, name: str) -> Protection:
        how = "one clone3 with every CLONE_NEW* flag and CLONE_PIDFD"
        if self.host.clone3_errno in (errno.ENOSYS, errno.EPERM):
            return self._refused(name, how, "clone3", self.host.clone3_errno, CLONE3_KERNEL)
        missing = self.untested(name, how)
        if missing:
            return missing
        if self.ev.unplaced:
            return self.line(name, False, how, self._placed())
        if self.ev.cgroup_failure is not None:
            place = "no cgroup to place init in (see cgroup-memory)"
        elif self.ev.cgroup_version == 2:
            need = ".".join(map(str, CLONE_INTO_CGROUP_KERNEL))
            place = f"CLONE_INTO_CGROUP (Linux {need}+) put init in its cgroup"
        else:
            place = ("on cgroup v1 the clone3 ran in a thread that had moved itself into the "
                     "sandbox's cgroups, so init started in them")
        return self.line(name, True, f"clone3 spawned init in every namespace; {place}")

    # -- capabilities of the host

    def image_overlay(self, name: str) -> Protection:
        how = ("on an image the root is an overlay made in the sandbox's user namespace "
               "(userxattr): the tree read-only as its lower, upper and work on a tmpfs of "
               "the sandbox's own (size = disk, nr_inodes = inodes), mounted nosuid,nodev")
        if self.ev is None:
            return self.untested(name, how)
        img = self.ev.image
        if img.failure is not None:
            return self.line(name, False, how, *img.failure)
        spec = self.ev.spec
        tail = img.root_mount.partition(" - ")[2]
        _, opts, fstype = _mount_fields(img.root_mount)
        fs_opts = set(tail.split()[2].split(",")) if len(tail.split()) > 2 else set()
        frsize, blocks, files = img.statfs
        problems = []
        if fstype != "overlay" or "userxattr" not in fs_opts:
            problems.append(f"/ is {fstype} ({','.join(sorted(fs_opts))}), not an overlay "
                            f"with userxattr")
        if not {"nosuid", "nodev"} <= opts or "ro" in opts:
            problems.append(f"/ is mounted {','.join(sorted(opts))}, not rw,nosuid,nodev")
        if img.read_back != "karotte":
            problems.append(f"the agent read back {img.read_back!r} of what it wrote")
        if (frsize * blocks, files) != (spec.disk, spec.inodes):
            problems.append(f"/ holds {_size(frsize * blocks)} and {files} inodes, asked "
                            f"{_size(spec.disk)} and {spec.inodes}")
        if img.tree_after != IMAGE_TREE:
            problems.append(f"the tree on the host holds {img.tree_after} after the agent's "
                            f"write: it reached the lower")
        return self.line(name, not problems,
                         f"kernel {self.host.kernel}: / is an overlay (userxattr), "
                         f"rw,nosuid,nodev; the agent's write to it read back inside and "
                         f"absent from the tree on the host, so it landed in the upper, a "
                         f"tmpfs of {_size(spec.disk)} and {spec.inodes} inodes (statfs of / "
                         f"inside)", "; ".join(problems))


Verdict = Callable[[_HostCheck, str], Protection]


def _namespace(seen: Callable[[_HostCheck], _Seen]) -> Verdict:
    """A namespace line: the agent's namespace is not the caller's, and seen() reads it."""
    return lambda check, name: check.namespace(name, seen)


def _cgroup(v1: str, v2: str, limit: Callable[[_HostCheck, str, str], Protection]) -> Verdict:
    """A cgroup line: v1 and v2 name what enforces it, limit() judges what the host read."""
    return lambda check, name: check.cgroup(name, {1: v1, 2: v2}, limit)


# Each line of `check` (karotte/protections.PROTECTIONS, in its order) -> its verdict.
# tests/test_probe.py fails if a line has no verdict here, or a verdict no line.
VERDICTS: dict[str, Verdict] = {
    "user-namespace": _namespace(_HostCheck.user_ns),
    "pid-namespace": _namespace(_HostCheck.pid_ns),
    "mount-namespace": _namespace(_HostCheck.mnt_ns),
    "network-namespace": _namespace(_HostCheck.net_ns),
    "ipc-namespace": _namespace(_HostCheck.ipc_ns),
    "uts-namespace": _namespace(_HostCheck.uts_ns),
    "cgroup-namespace": _namespace(_HostCheck.cgroup_ns),
    "seccomp": _HostCheck.seccomp,
    "no-new-privs": _HostCheck.no_new_privs,
    "capabilities-dropped": _HostCheck.capabilities,
    "unprivileged-agent-uid": _HostCheck.agent_uid,
    "separate-host-uid": _HostCheck.separate_host_uid,
    "own-userns-owner": _HostCheck.own_userns_owner,
    "new-session": _HostCheck.new_session,
    "closed-fds": _HostCheck.closed_fds,
    "cgroup-memory": _cgroup("memory.limit_in_bytes", "memory.max", _HostCheck.cgroup_memory),
    "cgroup-swap": _cgroup("memory.memsw.limit_in_bytes", "memory.swap.max",
                           _HostCheck.cgroup_swap),
    "cgroup-pids": _cgroup("pids.max", "pids.max", _HostCheck.cgroup_pids),
    "cgroup-cpu": _cgroup("cpu.cfs_quota_us / cpu.cfs_period_us", "cpu.max",
                          _HostCheck.cgroup_cpu),
    "cgroup-kill": _cgroup("freezer.state FROZEN, SIGKILL by pidfd, thaw",
                           "cgroup.kill (or cgroup.freeze, SIGKILL by pidfd)",
                           _HostCheck.cgroup_kill),
    "disk-quota": _HostCheck.disk_quota,
    "rlimits": _HostCheck.rlimits,
    "mount-setattr": _HostCheck.mount_setattr,
    "pidfd": _HostCheck.pidfd,
    "clone3": _HostCheck.clone3,
    "image-overlay": _HostCheck.image_overlay,
}


def judge(host: _Host, run: _Evidence | _Failure) -> tuple[Protection, ...]:
    """One Protection per line of `check`, in its order."""
    check = _HostCheck(host, run)
    return tuple(VERDICTS[name](check, name) for name in PROTECTIONS)
