"""Environments with a network for each phase (docs/egress.md, "Networks of an
environment"). The tests set network, grader_network and the servers' URLs on the class
in the trainer's process, where they are read; the grader gets what it needs from its
hidden files, since it imports this module again in its own sandbox."""
import os

from karotte.environment import Environment, Grade
from karotte.spec import MiB, SandboxSpec


class Fetched(Environment):
    """Fetch a number from the task's server and write twice it to answer.txt. The grader
    asks its own server (on grader_network's list, not the agent's) for the answer, from a
    ctx.run, and puts what it saw of its environment in the details."""

    deliverables = ("answer.txt",)
    limits = SandboxSpec(memory=256 * MiB, timeout=60)
    task_url = ""  # the agent's server (data.txt)
    answer_url = ""  # the grader's server (answer.txt)
    grader_command = 'curl -sSf --max-time 5 "$1"'  # what the ctx.run runs, with answer_url

    def prompt(self, seed):
        return f"Fetch {self.task_url}/data.txt and write twice the number to answer.txt."

    def hidden_files(self, seed):
        return {"answer_url.txt": self.answer_url + "/answer.txt",
                "command.txt": self.grader_command}

    def grade(self, ctx):
        url = (ctx.hidden / "answer_url.txt").read_text()
        command = (ctx.hidden / "command.txt").read_text()
        r = ctx.run(["sh", "-c", command, "sh", url], timeout=30)
        details = {
            "run_exit": r.exit_code, "run_stdout": r.stdout.decode(errors="replace"),
            "run_reaches": None if r.egress is None else [
                [x.host, x.allowed, x.reason] for x in r.egress.reaches],
            "grader_environ": sorted(f"{k}={v}" for k, v in os.environ.items()),
        }
        answer = ctx.read_deliverable("answer.txt", limit=100)
        expected = r.stdout.split()[-1] if r.exit_code == 0 and r.stdout.split() else None
        ok = expected is not None and answer is not None and answer.strip() == expected
        return Grade(1.0 if ok else 0.0, details)

    def reference_solution(self, seed):
        return [f"n=$(curl -sSf --max-time 5 {self.task_url}/data.txt) && "
                "echo $((n * 2)) > answer.txt"]
