"""ctx.git: a grader reads a workspace git repository with a real git, and nothing of the
repository's own configuration or hooks runs (D13)."""
from __future__ import annotations

import shlex

from envs.gitrepo import CommitTheFix

from karotte.battery import check
from karotte.episode import Episode

FIX = ["cd repo && sed -i 's/a - b/a + b/' calc.py"]
COMMIT = ["git add -A && git -c user.name=agent -c user.email=agent@example.com "
          "commit -q --no-verify -m 'fix add'"]
# Prints MARK, which its own text does not hold: a diff that shows the file is no alarm.
EVIL = "#!/bin/sh\nm=KAROTTE-GIT-RAN-AGENT-CODE-$((6 * 7))\necho $m\necho $m >&2\n"
PROGRAM = "/workspace/repo/.evil.sh"
HOOKS = "post-index-change reference-transaction post-checkout pre-auto-gc"
# Every place of a repository's config and work tree from which git can be made to run a
# program: set after the commit (they live in .git/config), so the agent's own git ran
# none of them, and the committed work is the honest fix.
PLANTED = FIX + [
    f"printf %s {shlex.quote(EVIL)} > .evil.sh && chmod +x .evil.sh && mkdir .hooks && "
    f"for h in {HOOKS}; do cp .evil.sh .hooks/$h; done",
    "echo '* diff=evil filter=evil' > .gitattributes",
] + COMMIT + [
    f"mkdir -p .git/hooks && for h in {HOOKS}; do cp .evil.sh .git/hooks/$h; done",
    " && ".join(f"git config {key} {shlex.quote(value)}" for key, value in (
    ("core.fsmonitor", PROGRAM), ("core.hooksPath", "/workspace/repo/.hooks"),
    ("core.pager", PROGRAM), ("pager.log", PROGRAM), ("alias.log", f"!{PROGRAM}"),
    ("alias.status", f"!{PROGRAM}"), ("diff.external", PROGRAM),
    ("diff.evil.textconv", PROGRAM), ("diff.evil.command", PROGRAM),
    ("filter.evil.clean", PROGRAM), ("filter.evil.smudge", PROGRAM),
    ("filter.evil.process", PROGRAM), ("filter.evil.required", "true"),
    ("log.showSignature", "true"), ("gpg.program", PROGRAM)))]


def play(commands):
    with Episode(CommitTheFix(), seed=1) as ep:
        ep.reset()
        for command in commands:
            r = ep.exec(command)
            assert r.exit_code == 0, r.text
        return ep.finish()


def test_a_fix_committed_in_a_workspace_repository_is_read_by_the_graders_git(no_leaks):
    outcome = play(FIX + COMMIT)
    assert (outcome.reward, outcome.reason) == (1.0, "graded"), outcome.details
    said = outcome.details["said"]
    assert said["log"] == "fix add\nadd, with a bug\n" and said["status"] == ""
    assert "-    return a - b\n+    return a + b" in said["diff"]


def test_uncommitted_work_is_seen_as_such(no_leaks):
    outcome = play(FIX)
    assert (outcome.reward, outcome.reason) == (0.0, "graded")
    assert outcome.details["said"]["status"] == " M calc.py\n"


def test_a_plain_git_in_the_grader_refuses_the_agents_repository(no_leaks):
    # Decided: safe.directory stays unset for the grader, which would make git honour
    # the agent's .git/config; ctx.git is the way to read the repository.
    outcome = play(FIX + COMMIT)
    assert "detected dubious ownership" in outcome.details["plain_git"]


def test_a_git_given_the_agents_own_git_dir_runs_the_programs_its_config_names(no_leaks):
    # Why ctx.git makes a git dir of its own: with --git-dir, git checks no ownership and
    # honours the agent's config (here core.fsmonitor, filter drivers).
    assert play(PLANTED).details["git_dir_of_the_agent_ran_its_code"] is True


def test_ENV_BUILD_01_the_agents_repository_config_and_hooks_run_nothing_in_the_grader(
        no_leaks):
    outcome = play(PLANTED)
    assert outcome.details["ran_agent_code"] is False, outcome.details["said"]
    assert (outcome.reward, outcome.reason) == (1.0, "graded"), outcome.details


def test_check_passes_a_repository_deliverable_and_attacks_the_work_in_it_first(no_leaks):
    report = check(CommitTheFix())
    failed = [(r.name, r.why) for r in report.results if not r.passed]
    assert report.passed, failed
    names = {r.name for r in report.results}
    assert {"exit0:repo/calc.py", "symlink-hidden:repo/calc.py", "hardlink:repo/calc.py"} <= names
