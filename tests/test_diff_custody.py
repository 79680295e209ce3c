"""Custody of the agent's whole diff of its image: after the kill, the overlay's upper is
scanned like the workspace into a private copy, the vetted changes; the programs of
ctx.run see the image with those changes, the grader reads them at ctx.changes and never
runs on them, and deliverables may be absolute paths of the image.

End to end, with real episodes of a root agent on the Debian image of conftest (a
bookworm by mmdebstrap with python3); the checks of the declaration need no sandbox.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import tempfile

import pytest

from conftest import bookworm_tree, needs_sandbox
from envs.basic import Addition
from envs.diff import PTH_MARK, DiffReports
from karotte import custody, grading, hostdirs
from karotte.environment import check_environment
from karotte.episode import AsyncEpisode, Episode
from karotte.errors import HostUnsupported
from karotte.scan import VIOLATIONS_KEPT, ScanError
from karotte.spec import MiB

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the Debian image is a root-owned "
                               "tree, which an unprivileged caller cannot run on "
                               "(docs/image-sandbox.md)")


def episodes(test):
    """The marks of the tests that play episodes on the Debian image."""
    return needs_sandbox()(ROOT_ONLY(test))


def in_the_lane_too(test):
    """A test the cgroup v2 VM lane runs as well (a sample: the lane's VM is slow)."""
    return pytest.mark.cgroup2(test)


OLD_TMPFS = (tuple(int(n) for n in re.findall(r"\d+", os.uname().release)[:2])
             < custody.TMPFS_SINCE and custody._fs_type(hostdirs.runtime_dir()) == "tmpfs")


@pytest.fixture(scope="session")
def runtime_dir():
    """Where the private directories go: the default, or where the default is a tmpfs that
    cannot hold the diff's copy (Linux before 6.6: the cgroup v2 VM lane's 6.1) one on
    /tmp, as an operator's KAROTTE_RUNTIME_DIR would be (the lane's /tmp is an ext4). One
    for the session: the grader library made there is kept for the process."""
    if not OLD_TMPFS:
        yield None
        return
    run = tempfile.mkdtemp(prefix="karotte-test-run-")
    os.chmod(run, 0o755)
    yield run
    shutil.rmtree(run)


@pytest.fixture
def on_image(monkeypatch, attack_tree, runtime_dir):
    """on_image(probe, deliverables) -> a DiffReports on the Debian image."""
    if runtime_dir:
        monkeypatch.setenv("KAROTTE_RUNTIME_DIR", runtime_dir)

    def declare(probe: dict | None = None, deliverables: tuple[str, ...] = ()):
        monkeypatch.setattr(DiffReports, "image", f"dir:{attack_tree}")
        monkeypatch.setattr(DiffReports, "deliverables", deliverables)
        monkeypatch.setattr(DiffReports, "PROBE", probe or {})
        return DiffReports()

    return declare


def play(env, *commands: str):
    """The outcome of an episode whose agent runs commands, each of which must succeed."""
    with Episode(env, seed=1) as ep:
        ep.reset()
        for command in commands:
            result = ep.exec(command)
            assert result.exit_code == 0, (command, result.text)
        return ep.finish()


def kinds(outcome) -> dict[str, str]:
    return {v.path: v.kind for v in outcome.violations}


def ran(outcome, which: str = "runs") -> list[tuple[int, str]]:
    return [(r["exit"], r["stdout"]) for r in outcome.details[which]]


def ours() -> set[str]:
    """This process's private directories, but the grader library kept for the process."""
    return {d for d in hostdirs.find_created_by() if not d.endswith("-lib")}


# -- the declaration ------------------------------------------------------------------------

def test_an_absolute_deliverable_on_the_hosts_userland_is_refused_naming_why(monkeypatch):
    monkeypatch.setattr(Addition, "deliverables", ("/etc/x",))
    with pytest.raises(ValueError, match=r"Addition.deliverables entry '/etc/x' is absolute: on "
                                         r"the host's userland the agent can change /workspace "
                                         r"only.*declare Addition.image"):
        check_environment(Addition())


@pytest.mark.parametrize("path, why", [
    ("/workspace/answer.txt", "under /workspace, the workspace: name its files relative"),
    ("/tmp/x", "under /tmp, a tmpfs of the agent's sandbox"),
    ("/home/agent/x", "under /home/agent, a tmpfs"),
    ("/proc/1/environ", "under /proc"),
    ("/etc/../hidden/x", "must name one file or directory plainly"),
    ("/etc/", "must name one file or directory plainly"),
    ("/", "must name one file or directory plainly"),
])
def test_an_absolute_deliverable_outside_the_images_diff_is_refused(path, why, monkeypatch):
    monkeypatch.setattr(DiffReports, "image", "dir:/srv/tree")
    monkeypatch.setattr(DiffReports, "deliverables", (path,))
    with pytest.raises(ValueError, match=f"DiffReports.deliverables entry '{path}'") as info:
        check_environment(DiffReports())
    assert why in str(info.value)


def test_an_absolute_deliverable_on_an_image_is_taken(monkeypatch):
    monkeypatch.setattr(DiffReports, "image", "dir:/srv/tree")
    monkeypatch.setattr(DiffReports, "deliverables", ("/etc/nginx/nginx.conf", "answer.txt"))
    assert check_environment(DiffReports()).deliverables == ("/etc/nginx/nginx.conf",
                                                             "answer.txt")


# -- what custody keeps of the diff ---------------------------------------------------------

@in_the_lane_too
@episodes
@pytest.mark.parametrize("deliverables", [("/etc/x",), ()], ids=["deliverable", "elsewhere"])
def test_DIFF_FIFO_01_a_fifo_at_etc_x(deliverables, on_image, no_leaks):
    probe = {"runs": [["sh", "-c", "test -e /etc/x && echo THERE || echo GONE"]]}
    outcome = play(on_image(probe, deliverables), "mkfifo /etc/x")
    assert kinds(outcome)["/etc/x"] == "fifo"
    if deliverables:  # scored as a FIFO at a workspace deliverable is
        assert (outcome.reason, outcome.reward) == ("scanner_rejected_required_output", 0.0)
        return
    assert outcome.reason == "graded", outcome.grader_log
    assert ran(outcome) == [(0, "GONE\n")]  # left out of the diff: ctx.run never meets it
    assert "/etc/x" not in outcome.details["tree"]


@episodes
def test_DIFF_SYMLINK_01_a_symlink_replacing_usr_bin_python3_reaches_ctx_run_alone(on_image,
                                                                                  no_leaks):
    """Safe: ctx.run's root is the agent's image, its diff and the submission, the system
    the agent made, and nothing it must not see (no /hidden); the link resolves there. The
    grader's own python3 is its image's: /changes is data, never the grader's root."""
    probe = {"runs": [["python3", "-c", "import sys; print(sys.version_info[:2])"],
                      ["readlink", "/usr/bin/python3"]]}
    outcome = play(on_image(probe),
                   "printf '#!/bin/sh\\necho FORGED\\n' > /usr/local/bin/forged && "
                   "chmod 755 /usr/local/bin/forged && "
                   "ln -sf /usr/local/bin/forged /usr/bin/python3 && python3 | grep -q FORGED")
    # graded: the grader ran under its image's python3, not the agent's link
    assert outcome.reason == "graded" and not outcome.violations, outcome.grader_log
    assert ran(outcome) == [(0, "FORGED\n"), (0, "/usr/local/bin/forged\n")]


@episodes
@pytest.mark.parametrize("deliverables", [("/usr/local/bin/suid",), ()],
                         ids=["deliverable", "elsewhere"])
def test_DIFF_SUID_01_a_setuid_file_in_the_diff(deliverables, on_image, no_leaks):
    probe = {"runs": [["sh", "-c", "test -e /usr/local/bin/suid && echo THERE || echo GONE"]]}
    outcome = play(on_image(probe, deliverables),
                   "cp /bin/true /usr/local/bin/suid && chmod 4755 /usr/local/bin/suid")
    assert kinds(outcome)["/usr/local/bin/suid"] == "setuid"
    if deliverables:
        assert outcome.reason == "scanner_rejected_required_output"
        return
    assert outcome.reason == "graded", outcome.grader_log
    assert ran(outcome) == [(0, "GONE\n")]


@in_the_lane_too
@episodes
def test_DIFF_DELETE_01_a_deleted_base_file_stays_deleted_for_ctx_run(on_image, no_leaks):
    probe = {"runs": [["cat", "/etc/debian_version"]],
             "pristine": [["cat", "/etc/debian_version"]], "read": ["/etc/debian_version"]}
    outcome = play(on_image(probe), "rm /etc/debian_version")
    assert outcome.reason == "graded", outcome.grader_log
    seen = outcome.details
    assert seen["deleted"] == ["/etc/debian_version"] and seen["replaced"] == [], seen
    (cat,), (pristine,) = ran(outcome), ran(outcome, "pristine")
    assert cat[0] != 0  # deleted for the agent's program too
    assert pristine[0] == 0 and pristine[1].startswith("12.")  # the image as it was
    # a whiteout in ctx.changes: read_deliverable tells a deleted file from a changed one
    assert seen["read"] == {"/etc/debian_version": None}
    assert (outcome.deleted_paths, outcome.changed_paths) == (1, 1)  # the file; /etc
    record = json.loads(json.dumps(outcome.to_dict()))
    assert (record["deleted_paths"], record["changed_paths"]) == (1, 1)


@episodes  # not in the lane: its 6.1 tmpfs upper has no user xattrs, and rm -rf of an image
# directory fails there with EIO in the agent's own sandbox
def test_DIFF_OPAQUE_01_a_replaced_directory_holds_only_what_the_agent_put_there(on_image,
                                                                                 no_leaks):
    probe = {"runs": [["ls", "-A", "/etc/apt"]], "read": ["/etc/apt/only"]}
    outcome = play(on_image(probe),
                   "rm -rf /etc/apt && mkdir /etc/apt && echo new > /etc/apt/only")
    assert outcome.reason == "graded", outcome.grader_log
    assert outcome.details["replaced"] == ["/etc/apt"], outcome.details
    assert ran(outcome) == [(0, "only\n")]  # nothing of the image's /etc/apt is left
    assert outcome.details["read"] == {"/etc/apt/only": "new\n"}


DEB = ("mkdir -p /root/pkg/DEBIAN /root/pkg/usr/bin && "
       "printf 'Package: karotte-hello\\nVersion: 1.0\\nArchitecture: all\\n"
       "Maintainer: Karotte <tests@karotte.invalid>\\nDescription: a test package\\n' "
       "> /root/pkg/DEBIAN/control && "
       "printf '#!/bin/sh\\necho hello from the package\\n' > /root/pkg/usr/bin/karotte-hello && "
       "chmod 755 /root/pkg/usr/bin/karotte-hello && "
       "dpkg-deb --build /root/pkg /root/hello.deb >/dev/null && dpkg -i /root/hello.deb")


@in_the_lane_too
@episodes
def test_DIFF_DPKG_01_a_package_the_root_agent_installs_is_seen_by_ctx_run(on_image, no_leaks):
    probe = {"runs": [["karotte-hello"],
                      ["dpkg-query", "-W", "-f=${Status}", "karotte-hello"],
                      ["python3", "-I", "-c", "import agentmod; print(agentmod.ANSWER)"]]}
    outcome = play(on_image(probe), DEB,
                   "echo 'ANSWER = 42' > /usr/lib/python3/dist-packages/agentmod.py")
    assert outcome.reason == "graded", outcome.grader_log
    assert ran(outcome) == [(0, "hello from the package\n"), (0, "install ok installed"),
                            (0, "42\n")], outcome.details["runs"]


@in_the_lane_too
@episodes
def test_DIFF_DPKG_01_a_packages_relative_and_absolute_symlinks_work_in_ctx_run(on_image,
                                                                               no_leaks):
    lib = "/usr/lib/libkarotte.so"
    deb = ("mkdir -p /root/pkg/DEBIAN /root/pkg/usr/lib /root/pkg/usr/bin && "
           "printf 'Package: karotte-links\\nVersion: 1.0\\nArchitecture: all\\n"
           "Maintainer: Karotte <tests@karotte.invalid>\\nDescription: links\\n' "
           "> /root/pkg/DEBIAN/control && "
           f"echo 'the library' > /root/pkg{lib}.1.2.3 && "
           f"ln -s libkarotte.so.1.2.3 /root/pkg{lib}.1 && "
           "printf '#!/bin/sh\\necho hello from the link\\n' > /root/pkg/usr/bin/karotte-real && "
           "chmod 755 /root/pkg/usr/bin/karotte-real && "
           "ln -s /usr/bin/karotte-real /root/pkg/usr/bin/karotte-abs && "
           "dpkg-deb --build --root-owner-group /root/pkg /root/links.deb >/dev/null && "
           "dpkg -i /root/links.deb >/dev/null")
    probe = {"runs": [["cat", f"{lib}.1"], ["readlink", f"{lib}.1", "/usr/bin/karotte-abs"],
                      ["karotte-abs"], ["dpkg", "-L", "karotte-links"]]}
    outcome = play(on_image(probe), deb)
    assert outcome.reason == "graded" and not outcome.violations, outcome.grader_log
    (cat, readlink, run, listed) = ran(outcome)
    assert (cat, readlink, run) == ((0, "the library\n"),
                                    (0, "libkarotte.so.1.2.3\n/usr/bin/karotte-real\n"),
                                    (0, "hello from the link\n")), outcome.details["runs"]
    assert f"{lib}.1\n" in listed[1] and "/usr/bin/karotte-abs\n" in listed[1]


@in_the_lane_too
@episodes
def test_DIFF_SYMLINK_03_a_link_to_hidden_gives_a_naive_grader_nothing(monkeypatch,
                                                                            attack_tree,
                                                                            runtime_dir,
                                                                            no_leaks):
    """/etc/answer -> /hidden/expected.txt, and /etc/way -> /hidden on the way: the
    grader's process opens both under ctx.changes and follows neither (ELOOP), readlink
    shows the link, read_deliverable gives None, and ctx.run's root has no /hidden."""
    from envs.naive_diff import NaiveDiff
    if runtime_dir:
        monkeypatch.setenv("KAROTTE_RUNTIME_DIR", runtime_dir)
    monkeypatch.setattr(NaiveDiff, "image", f"dir:{attack_tree}")
    outcome = play(NaiveDiff(), "ln -s /hidden/expected.txt /etc/answer && ln -s /hidden /etc/way")
    assert outcome.reason == "graded" and not outcome.violations, outcome.grader_log
    assert outcome.reward == 0.0, outcome.details
    assert outcome.details == {"etc/answer": "errno 40", "etc/way/expected.txt": "errno 40",
                               "readlink": "/hidden/expected.txt", "read_deliverable": None,
                               "runs": [1]}


@episodes
@pytest.mark.parametrize("deliverable, command, path", [
    ("/etc/x", "ln -s /etc/issue /etc/x", "/etc/x"),
    ("/etc/app/conf", "ln -s /etc /etc/app", "/etc/app")], ids=["at", "on-the-way"])
def test_DIFF_SYMLINK_04_a_symlink_at_a_deliverable_is_still_a_violation(
        deliverable, command, path, on_image, no_leaks):
    outcome = play(on_image({}, (deliverable,)), command)
    assert kinds(outcome) == {path: "symlink"}
    assert (outcome.reason, outcome.reward) == ("scanner_rejected_required_output", 0.0)


@in_the_lane_too
@episodes
def test_DIFF_PTH_01_an_agents_pth_in_site_packages_does_not_run_in_the_grader(on_image,
                                                                               no_leaks):
    show = ["python3", "-I", "-c", f"import os; print(os.environ.get({PTH_MARK!r}))"]
    outcome = play(on_image({"runs": [show]}),
                   f"echo \"import os; os.environ['{PTH_MARK}'] = 'ran'\" "
                   "> /usr/lib/python3/dist-packages/zz-agent.pth && "
                   f"{' '.join(show[:3])} \"{show[3]}\" | grep -qx ran")  # it runs in the agent's
    assert outcome.reason == "graded", outcome.grader_log
    assert outcome.details["grader_pth"] is None  # the grader's root is the image as it was
    assert ran(outcome) == [(0, "ran\n")]  # the agent's programs run with it, as they did


@episodes
def test_DIFF_GIT_01_a_git_the_agent_put_in_the_diff_does_not_run_on_the_image_as_it_was(
        on_image, no_leaks):
    # ctx.git runs /usr/bin/git with changes=False: the image's git, or none.
    probe = {"runs": [["/usr/bin/git", "log"]], "pristine": [["/usr/bin/git", "log"]]}
    outcome = play(on_image(probe), "printf '#!/bin/sh\\necho FORGED\\n' > /usr/bin/git && "
                                    "chmod 755 /usr/bin/git")
    assert outcome.reason == "graded", outcome.grader_log
    (run,), (pristine,) = ran(outcome), ran(outcome, "pristine")
    assert run == (0, "FORGED\n") and pristine[0] == 127  # this image has no git of its own


# The smallest Debian image with a git of its own: bookworm's essential set, with python3
# for the grader. Built by mmdebstrap once a day into conftest's IMAGE_CACHE; without
# Debian's archive the test skips, naming why.
GIT_PACKAGES = ("git", "python3")
FORGED = "KAROTTE-FORGED-GIT-RAN"  # what the agent's /usr/bin/git prints


@pytest.fixture(scope="session")
def git_tree() -> str:
    return bookworm_tree("essential", GIT_PACKAGES)


@episodes
def test_DIFF_GIT_01_a_git_the_agent_put_in_the_diff_never_runs_in_ctx_git(
        on_image, git_tree, monkeypatch, no_leaks):
    # The agent commits with the image's git, then puts a git of its own at /usr/bin/git,
    # which tells a history of its choosing. ctx.git reads the repository with the image's
    # git as it was; ctx.run, the control, runs the agent's system and finds the forgery.
    env = on_image({"git": [["log", "--format=%s"]], "runs": [["/usr/bin/git", "log"]]})
    monkeypatch.setattr(DiffReports, "image", f"dir:{git_tree}")
    forged = f"#!/bin/sh\necho {FORGED}\necho {FORGED} >&2\n"
    git = "git -c safe.directory=/workspace"  # the workspace is the agent's uid's
    outcome = play(env, f"{git} init -q && echo work > work.txt && {git} add work.txt && "
                        f"{git} -c user.name=agent -c user.email=agent@example.com "
                        "commit -q -m 'the honest commit'",
                   f"printf '{forged}' > /usr/bin/git && chmod 755 /usr/bin/git && "
                   f"git log | grep -qx {FORGED}")
    assert outcome.reason == "graded", outcome.grader_log
    assert "/usr/bin/git" in outcome.details["tree"]  # in the vetted diff
    (log,) = outcome.details["git"]
    assert (log["exit"], log["stdout"]) == (0, "the honest commit\n"), log
    assert FORGED not in log["stdout"] + log["stderr"]
    assert ran(outcome) == [(0, f"{FORGED}\n")]  # the replaced git is in the diff


@episodes
@pytest.mark.parametrize("commands, reward", [
    (["echo 'served by karotte' >> /etc/issue"], 1.0), ([], 0.0)], ids=["changed", "untouched"])
def test_DIFF_HARBOR_01_an_etc_file_given_as_an_absolute_deliverable_is_checked(
        commands, reward, on_image, no_leaks):
    probe = {"read": ["/etc/issue"], "wanted": "served by karotte",
             "runs": [["grep", "-c", "served by karotte", "/etc/issue"]]}
    outcome = play(on_image(probe, ("/etc/issue",)), *commands)
    assert (outcome.reason, outcome.reward) == ("graded", reward), outcome.grader_log
    read = outcome.details["read"]["/etc/issue"]
    if commands:  # the file as the agent left it: the image's lines, then the agent's
        assert read.startswith("Debian GNU/Linux 12") and read.endswith("served by karotte\n")
        assert ran(outcome) == [(0, "1\n")]
    else:  # read_deliverable of an absolute path is the diff's: None where it is unchanged
        assert read is None and ran(outcome)[0][0] == 1


@episodes
def test_REC_BOUND_01_the_violations_of_both_scans_are_held_within_one_bound(on_image,
                                                                             no_leaks):
    outcome = play(on_image(deliverables=("/etc/zz",)),
                   "for i in $(seq 150); do mkfifo /workspace/w$i /etc/f$i; done",
                   "mkfifo /etc/zz")
    assert outcome.reason == "scanner_rejected_required_output"  # held after 300 others
    paths = [v.path for v in outcome.violations]
    assert "/etc/zz" in paths and len(paths) == VIOLATIONS_KEPT + 1
    assert paths[:VIOLATIONS_KEPT] == sorted(paths[:VIOLATIONS_KEPT], key=lambda p: (
        p.startswith("/"),))  # the workspace's first, then the diff's
    assert outcome.violations_dropped == 300 - VIOLATIONS_KEPT
    assert len(json.dumps(outcome.to_dict())) < 1 * MiB


# -- nothing left behind --------------------------------------------------------------------

@episodes
@pytest.mark.parametrize("commands, deliverables, reason", [
    (["rm /etc/debian_version"], (), "graded"),
    (["mkfifo /etc/x"], ("/etc/x",), "scanner_rejected_required_output"),
], ids=["graded", "rejected"])
def test_the_changes_directory_goes_with_the_submission(commands, deliverables, reason,
                                                        on_image, no_leaks):
    env = on_image({"runs": [["true"]]}, deliverables)
    grading.grader_library("envs")  # made once per process, and kept
    before = ours()
    made: list[str] = []
    real = hostdirs.new_dir

    def noting(tag, mode):
        made.append(real(tag, mode))
        return made[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hostdirs, "new_dir", noting)
        outcome = play(env, *commands)
    assert outcome.reason == reason, outcome.grader_log
    assert any(d.endswith("-changes") for d in made), made  # there was one
    assert ours() == before and not any(os.path.exists(d) for d in made)


@episodes
def test_a_diff_scan_that_fails_leaves_nothing_either(on_image, monkeypatch, no_leaks):
    env = on_image()
    grading.grader_library("envs")
    before = ours()
    real = custody.scan_changes

    def fails_midway(upper_fd, dest, limits, **kwargs):
        real(upper_fd, dest, limits, **kwargs)  # the copy is made, then the host fails
        raise ScanError("cannot write the copy of /etc/x in dest_dir: No space left on device")

    monkeypatch.setattr(custody, "scan_changes", fails_midway)
    outcome = play(env, "echo x > /etc/x")
    assert outcome.reason == "infra_error"
    assert outcome.infra_error.startswith("custody failed: cannot write the copy of /etc/x")
    assert ours() == before


@episodes
def test_the_async_face_hands_the_diff_over_too(on_image, no_leaks):
    env = on_image({"runs": [["cat", "/etc/debian_version"]]})

    async def episode():
        async with AsyncEpisode(env, seed=1) as ep:
            await ep.reset()
            assert (await ep.exec("rm /etc/debian_version")).exit_code == 0
            return await ep.finish()

    outcome = asyncio.run(episode())
    assert outcome.reason == "graded", outcome.grader_log
    assert "/etc/debian_version" in outcome.details["deleted"] and ran(outcome)[0][0] != 0


@needs_sandbox()
def test_on_the_hosts_userland_there_is_no_diff(monkeypatch, no_leaks):
    monkeypatch.setattr(DiffReports, "PROBE", {"runs": [["true"]]})
    monkeypatch.setattr(DiffReports, "limits", DiffReports.limits.__class__())
    outcome = play(DiffReports())
    assert outcome.reason == "graded", outcome.grader_log
    seen = outcome.details
    assert (seen["changes"], seen["deleted"], seen["replaced"]) == (None, [], [])
    assert (outcome.changed_paths, outcome.deleted_paths) == (0, 0)


@episodes
def test_a_grader_on_the_hosts_userland_reads_the_diff_of_the_agents_image(on_image,
                                                                          monkeypatch,
                                                                          no_leaks):
    env = on_image({"read": ["/etc/issue"], "runs": [["cat", "/etc/issue"]]}, ("/etc/issue",))
    monkeypatch.setattr(DiffReports, "grader_image", "host")
    outcome = play(env, "echo changed > /etc/issue")
    assert outcome.reason == "graded", outcome.grader_log
    assert outcome.details["read"] == {"/etc/issue": "changed\n"}
    assert ran(outcome) == [(0, "changed\n")]  # ctx.run: still the agent's image and diff


@in_the_lane_too
@episodes
@pytest.mark.skipif(not OLD_TMPFS, reason="needs a tmpfs runtime directory on Linux before "
                    "6.6 (the cgroup v2 VM lane's 6.1)")
def test_a_runtime_dir_that_cannot_hold_the_diff_is_refused_at_reset_naming_the_fix(
        attack_tree, monkeypatch, no_leaks):
    monkeypatch.setattr(DiffReports, "image", f"dir:{attack_tree}")
    with Episode(DiffReports(), seed=1) as ep:
        with pytest.raises(HostUnsupported, match=r"set KAROTTE_RUNTIME_DIR to a directory on "
                                                  r"ext4, xfs or btrfs") as info:
            ep.reset()
    assert info.value.protections == ("image-overlay",)
