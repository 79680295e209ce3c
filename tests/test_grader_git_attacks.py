"""ctx.git against repositories inside the agent's repository (D13, ENV-BUILD-01): git runs
a child git in each submodule with that submodule's own git dir and config, which the
agent wrote, so ctx.git refuses a work tree that holds one."""
from __future__ import annotations

import shlex

from envs.gitrepo import MARK
from envs.gitroot import CommitTheFixAtTheRoot

from karotte.episode import Episode
from test_grader_git import play

EVIL = "#!/bin/sh\nm=KAROTTE-GIT-RAN-AGENT-CODE-$((6 * 7))\necho $m\necho $m >&2\n"
AGENT = "git -c user.name=agent -c user.email=agent@example.com"
# The honest fix, committed, plus a committed submodule whose own config names a program:
# git status in the outer repository asks the submodule's git whether it is modified.
SUBMODULE = [
    "cd repo && sed -i 's/a - b/a + b/' calc.py",
    f"printf %s {shlex.quote(EVIL)} > .evil.sh && chmod +x .evil.sh",
    f"mkdir sub && cd sub && git init -q && echo x > f && git add f && {AGENT} commit -qm s && cd ..",
    f"git add sub calc.py .evil.sh 2>/dev/null && {AGENT} commit -qm 'fix add'",
    "git -C sub config core.fsmonitor /workspace/repo/.evil.sh",
]


def test_ENV_BUILD_01_a_submodules_own_config_runs_nothing_in_the_graders_git(no_leaks):
    outcome = play(SUBMODULE)
    assert MARK not in str(outcome.details) + outcome.grader_log
    assert (outcome.reward, outcome.reason) == (0.0, "grader_crashed")
    assert "repo/sub/.git is a git repository inside repo" in outcome.grader_log


def test_ENV_BUILD_01_an_embedded_repository_with_a_gitfile_is_refused_too(no_leaks):
    # A gitfile ("gitdir: ...") makes git use the directory it names, the agent's too.
    outcome = play(SUBMODULE[:3] + [
        "mv sub/.git .subgit && echo 'gitdir: ../.subgit' > sub/.git && "
        "mkdir -p .git/info && echo /.subgit >> .git/info/exclude",
        *SUBMODULE[3:]])
    assert MARK not in str(outcome.details) + outcome.grader_log
    assert (outcome.reward, outcome.reason) == (0.0, "grader_crashed")
    assert "repo/sub/.git is a git repository inside repo" in outcome.grader_log


def test_ctx_git_reads_a_repository_at_the_workspace_root_by_default(no_leaks):
    # repo="." is ctx.git's default: the submission itself is the work tree.
    with Episode(CommitTheFixAtTheRoot(), seed=1) as ep:
        ep.reset()
        for command in ep.reference_solution():
            assert ep.exec(command).exit_code == 0
        outcome = ep.finish()
    assert (outcome.reward, outcome.reason) == (1.0, "graded"), (outcome.details,
                                                                 outcome.grader_log)
