"""Binds: where a host path may go in the sandbox, and what a writable one is."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sysconfig

import pytest

from karotte.sandbox import AGENT_UID, DEFAULT_UID_BASE, Sandbox, ns_owner_ids
from karotte.spec import Bind, BindError, MiB, SandboxSpec

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the agent then runs "
                                "as a host uid of its sandbox's own")


@pytest.mark.parametrize("dst", ["/", "/proc", "/proc/sys", "/dev", "/dev/shm", "/sys"])
def test_a_bind_onto_the_root_or_a_kernel_filesystem_is_refused_when_it_is_made(dst):
    with pytest.raises(BindError, match="bind somewhere else|whole root"):
        Bind("/srv", dst)


@pytest.mark.parametrize("dst", ["data", "/data/", "/data/../etc", "//data", "/a/./b"])
def test_a_bind_destination_must_be_absolute_and_normalised(dst):
    with pytest.raises(BindError, match="absolute|not normalised"):
        Bind("/srv", dst)


def test_two_binds_onto_one_destination_are_refused():
    with pytest.raises(BindError, match="two binds onto /data"):
        SandboxSpec(binds=(Bind("/srv", "/data"), Bind("/opt", "/data")))


def test_a_bind_inside_another_bind_is_refused():
    with pytest.raises(BindError, match="/data/more is inside the bind /srv -> /data"):
        SandboxSpec(binds=(Bind("/opt", "/data/more"), Bind("/srv", "/data")))


@pytest.mark.parametrize("dst, hidden", [("/usr", "/usr"), ("/bin", "/bin"), ("/etc", "/etc"),
                                         ("/tmp", "/tmp"), ("/home/agent", "/home/agent"),
                                         ("/home", "/home/agent")])
def test_a_bind_onto_a_mount_of_karotte_is_refused_naming_what_it_would_hide(
        no_leaks, shared_dir, dst, hidden):
    with pytest.raises(BindError, match=f"would hide {hidden},"):
        Sandbox(SandboxSpec(binds=(Bind(shared_dir, dst),)))


def test_a_bind_onto_workspace_puts_the_host_directory_in_its_place(no_leaks, shared_dir):
    with open(os.path.join(shared_dir, "input.txt"), "w") as f:
        f.write("from the host")
    with Sandbox(SandboxSpec(binds=(Bind(shared_dir, "/workspace"),))) as sb:
        assert sb.exec(["cat", "input.txt"]).stdout == b"from the host"  # the cwd
        r = sb.exec(["touch", "new"])
        assert r.exit_code != 0 and b"Read-only" in r.stderr


def test_a_bind_below_a_read_only_mount_needs_a_mount_point_that_exists_there(no_leaks, shared_dir):
    with pytest.raises(BindError, match="/usr is read-only in the sandbox.*/usr/karotte-no-such"):
        Sandbox(SandboxSpec(binds=(Bind(shared_dir, "/usr/karotte-no-such"),)))
    hosts = os.path.join(shared_dir, "hosts")
    with open(hosts, "w") as f:
        f.write("10.0.0.1 db\n")
    os.chmod(hosts, 0o644)
    with Sandbox(SandboxSpec(binds=(Bind(hosts, "/etc/hosts"),))) as sb:
        assert sb.exec(["cat", "/etc/hosts"]).stdout == b"10.0.0.1 db\n"


def test_a_writable_bind_is_outside_the_disk_quota_but_each_file_is_capped_by_the_file_size_limit(
        no_leaks, shared_dir):
    os.chmod(shared_dir, 0o777)  # writable by whatever host uid the agent is
    spec = SandboxSpec(disk=8 * MiB, binds=(Bind(shared_dir, "/data", writable=True),))
    with Sandbox(spec) as sb:
        r = sb.exec("head -c 6M /dev/zero > /data/a && head -c 6M /dev/zero > /data/b")
        assert r.exit_code == 0, r.stderr  # 12 MiB through a bind of a sandbox with 8 MiB
        r = sb.exec("head -c 9M /dev/zero > /data/c")
        assert r.exit_code != 0 and b"File too large" in r.stderr
    assert os.path.getsize(os.path.join(shared_dir, "b")) == 6 * MiB
    assert os.path.getsize(os.path.join(shared_dir, "c")) == 8 * MiB


@needs_root
def test_as_root_a_writable_bind_needs_no_mode_777_and_takes_the_agents_own_uid_and_gid(
        no_leaks, shared_dir):
    # The documented set-up: the agent gid (the same in every sandbox) may write the
    # directory; nobody else gets anything.
    agent_gid = DEFAULT_UID_BASE + AGENT_UID
    os.chown(shared_dir, 0, agent_gid)
    os.chmod(shared_dir, 0o2770)
    spec = SandboxSpec(binds=(Bind(shared_dir, "/data", writable=True),))
    with Sandbox(spec) as sb:
        assert sb.exec("echo made > /data/out").exit_code == 0
        agent = os.stat(".", dir_fd=sb.workspace_fd).st_uid
    st = os.stat(os.path.join(shared_dir, "out"))
    assert st.st_uid == agent and st.st_uid in ns_owner_ids() and st.st_gid == agent_gid
    assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID)
    with Sandbox(SandboxSpec(binds=(Bind(shared_dir, "/data"),))) as sb:
        assert sb.exec(["cat", "/data/out"]).stdout == b"made\n"  # another sandbox reads it


UNPRIVILEGED_RW_BIND = """
import sys
from karotte.sandbox import Sandbox
from karotte.protections import NO_CGROUP
from karotte.spec import Bind, SandboxSpec
spec = SandboxSpec(binds=(Bind(sys.argv[1], "/data", writable=True),),
                   allow_degraded=NO_CGROUP)
with Sandbox(spec) as sb:
    r = sb.exec("id -u; echo made > /data/out")
    print(r.stdout.decode().strip(), r.exit_code, r.stderr.decode().strip())
"""


@needs_root
def test_an_unprivileged_callers_writable_bind_is_written_as_the_caller_itself(shared_dir):
    nobody = 65534
    if not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs setpriv (util-linux) and /usr/bin/python3 to run as uid 65534")
    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    site = sysconfig.get_paths()["purelib"]
    os.chown(shared_dir, nobody, nobody)
    os.chmod(shared_dir, 0o700)  # the caller's own directory, closed to everyone else
    r = subprocess.run(["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups",
                        "/usr/bin/python3", "-c", UNPRIVILEGED_RW_BIND, shared_dir],
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{project}:{site}"},
                       capture_output=True, text=True, timeout=60, cwd="/")
    if "import" in r.stderr and r.returncode != 0:
        pytest.skip(f"uid {nobody} cannot import karotte from this checkout: {r.stderr[-200:]}")
    assert r.returncode == 0 and r.stdout.split() == [str(AGENT_UID), "0"], r.stderr + r.stdout
    st = os.stat(os.path.join(shared_dir, "out"))
    assert (st.st_uid, st.st_gid) == (nobody, nobody)


@pytest.mark.cgroup2  # the VM lane's 6.1 and 6.12 too
def test_a_bind_that_follows_no_symlinks_shows_each_link_and_resolves_none(
        no_leaks, shared_dir):
    # What the grader's /changes is: a tree of another's links (a relative one, an
    # absolute one to a file every sandbox has, one to a directory on the way).
    with open(os.path.join(shared_dir, "file"), "w") as f:
        f.write("the file itself\n")
    os.symlink("file", os.path.join(shared_dir, "relative"))
    os.symlink("/etc/hostname", os.path.join(shared_dir, "absolute"))
    os.symlink("/etc", os.path.join(shared_dir, "dir"))
    script = ("cat /data/file; for l in relative absolute dir/hostname; do "
              "cat /data/$l >/dev/null 2>&1 && echo FOLLOWED $l; done; "
              "readlink /data/relative /data/absolute /data/dir; ls /data/dir/ >/dev/null 2>&1 "
              "&& echo LISTED; true")
    spec = SandboxSpec(binds=(Bind(shared_dir, "/data", follow_symlinks=False),))
    with Sandbox(spec) as sb:
        r = sb.exec(["sh", "-c", script])
        assert r.stdout == b"the file itself\nfile\n/etc/hostname\n/etc\n", r
        r = sb.exec(["python3", "-c", "import os\ntry:\n    os.stat('/data/relative')\n"
                                      "except OSError as e:\n    print(e.errno)"])
        assert r.stdout == b"40\n", r  # ELOOP
    with Sandbox(SandboxSpec(binds=(Bind(shared_dir, "/data"),))) as sb:  # the default follows
        r = sb.exec(["sh", "-c", script])
        assert b"FOLLOWED relative\nFOLLOWED absolute\nFOLLOWED dir/hostname\n" in r.stdout, r
        assert r.stdout.endswith(b"LISTED\n"), r


@pytest.mark.parametrize("name", ["writable", "follow_symlinks"])
def test_a_binds_flags_are_booleans(name):
    with pytest.raises(BindError, match=f"bind {name} must be True or False, got 'no'"):
        Bind("/srv", "/data", **{name: "no"})
