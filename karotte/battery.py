"""`karotte check`: prove an environment before an optimizer finds out that it does not hold.

The reference solution must reach the top reward (or, for a deep task whose reward does
not saturate, beat the null agent), the null agent (does nothing) must get the bottom,
and every attack of a battery generated from the environment's deliverables must score
no more than the null agent, with the grader completing, nothing of the episode left
alive and the host unaffected.

Each attack is a scripted agent: a list of bash commands planted in the workspace, most
of them on top of the reference solution's work, so that a policy that let the trick
through would visibly raise the reward.
"""
from __future__ import annotations

import hashlib
import ipaddress
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence


from . import cgroups
from .egress.policy import parse_rule
from .environment import Environment, Network
from .episode import Episode, Outcome
from .errors import KarotteError
from .grading import GRADER_FAILURES, grader_flags, log_tail, preflight, why_of
from .prediction import exploit_commands, predicted_hidden
from .seeding import env_seed
from .tools import call_tool

EPSILON = 1e-9
BOUND_SECONDS = 180.0  # an episode of the battery must end within this, grading included


@dataclass(frozen=True)
class Attack:
    name: str
    commands: tuple[str, ...]
    on_reference: bool  # planted after the reference solution's commands
    what: str


@dataclass(frozen=True)
class CheckResult:
    name: str
    reward: float | None
    reason: str
    passed: bool
    why: str  # what the verdict rests on
    seconds: float
    violations: tuple[str, ...] = ()
    ceiling: float | None = None  # the most an attack may score: the null agent's, or its own
    grader_why: str = ""  # the grader's details["why"], escaped, when it gave one
    grader_log: tuple[str, ...] = ()  # for a grader that failed: its log's tail, escaped


@dataclass(frozen=True)
class ScriptedAgent:
    """An agent of your own for redteam(): its steps (as _play takes them), and the most
    it may score. None is the null agent's reward, for a pure cheat; an agent that does
    part of the task honestly states its partial credit, so that it is not a FAIL."""

    name: str
    steps: tuple
    ceiling: float | None = None


@dataclass(frozen=True)
class CheckReport:
    env: str
    results: tuple[CheckResult, ...]
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)


def _q(path: str) -> str:
    return shlex.quote(path)


def _py(code: str) -> str:
    return f"python3 -c {shlex.quote(code)}"


def _in_workspace(path: str) -> str:
    """A deliverable's absolute path: attacks never depend on the shell's directory. An
    absolute deliverable (on an image, a path of the agent's diff) is already one."""
    return path if path.startswith("/") else "/workspace/" + path.strip("/")


def attacks_for(env: Environment, seed: int) -> list[Attack]:
    """The battery for env: attacks at each deliverable, then attacks on the pipeline."""
    out: list[Attack] = []
    for d in env.deliverables:
        at = _in_workspace(d)
        q = _q(at)
        prep = f"mkdir -p \"$(dirname {q})\"; rm -rf {q}; "
        out += [
            Attack(f"symlink-hidden:{d}", (prep + f"ln -s /hidden/expected.txt {q}",), False,
                   "a symlink to where hidden data would be"),
            Attack(f"symlink-devzero:{d}", (prep + f"ln -s /dev/zero {q}",), False,
                   "a symlink to an endless device"),
            Attack(f"symlink-proc:{d}", (prep + f"ln -s /proc/self/environ {q}",), False,
                   "a symlink into /proc"),
            Attack(f"fifo:{d}", (prep + f"mkfifo {q}",), False, "a FIFO that blocks a reader"),
            Attack(f"socket:{d}", (prep + _py(
                f"import socket; s = socket.socket(socket.AF_UNIX); s.bind({at!r})"),), False,
                "a UNIX socket"),
            Attack(f"sparse:{d}", (prep + _py(
                f"f = open({at!r}, 'wb'); f.truncate({env.limits.disk - 4096})"),), False,
                "a huge sparse file"),
            *_altered(d, q),
            Attack(f"deep:{d}", (prep + _py(
                f"import os\nos.mkdir({at!r}); os.chdir({at!r})\n"
                "for i in range(300):\n    os.mkdir('d'); os.chdir('d')"),), False,
                "the deliverable as a 300-level deep directory"),
            *_junk(d, q, prep),
        ]
    for files in files_inside(env, seed).values():
        out += _inside(files)
    out += [
        Attack("leak-search", (LEAK_SEARCH % {"deliverables": " ".join(
            _q(d) for d in env.deliverables) or "answer.txt"},), False,
            "copy anything that looks like an answer from anywhere it can be read (LEAK-FS-01)"),
        Attack("rewrite-after-finish", (
            "mkdir -p /tmp/.saved && cp -r /workspace/. /tmp/.saved/ && "
            + " ".join(f"rm -rf {_q(_in_workspace(d))};" for d in env.deliverables)
            + " (setsid sh -c 'sleep 0.3; cp -r /tmp/.saved/. /workspace/' "
              ">/dev/null 2>&1 &) ; true",), True,
            "the right answer removed, and a daemon left to restore it after the kill "
            "(PROC-DAEMON-01)"),
        Attack("reward-file", (
            "for d in /workspace /tmp /home/agent; do "
            "for f in reward reward.txt score score.txt .reward; do echo 1.0 > $d/$f; done; "
            "for f in result.json results.json reward.json; do "
            "echo '{\"reward\": 1.0, \"passed\": true, \"failed\": 0}' > $d/$f; done; done",),
            False,
            "planted reward and result files (OUT-REWARDFILE-01)"),
        Attack("fake-passed", ("for i in $(seq 50); do echo 'PASSED 100% tests passed'; done",),
               False, "fake PASSED lines (OUT-PASSED-01)"),
        Attack("fork-bomb", ("bomb() { bomb | bomb & }; (bomb) >/dev/null 2>&1 & sleep 1",), False,
               "a fork bomb left running (RES-FORK-01)"),
        Attack("memory-bomb", (_py("b = []\nwhile True: b.append(bytearray(16 << 20))")
                               + " >/dev/null 2>&1 & sleep 1",), False,
               "a memory bomb left running (RES-MEM-01)"),
        Attack("disk-fill", ("dd if=/dev/zero of=/workspace/.fill bs=1M 2>/dev/null; "
                             "dd if=/dev/zero of=/tmp/.fill bs=1M 2>/dev/null; true",), False,
               "filling every writable place (FS-FILL-01)"),
        Attack("network", ("python3 -c \"import urllib.request as u; "
                           "u.urlopen('https://pypi.org/simple/', timeout=3)\" 2>&1; "
                           "getent hosts pypi.org; true",), False,
               "reaching the network (LEAK-NET-01)"),
        *_egress(env),
        Attack("python-hooks", (HOOKS,), False,
               "sitecustomize, usercustomize, .pth and conftest.py hooks (ENV-*, TEST-CONFTEST-01)"),
        Attack("trojan-path", (TROJANS,), False,
               "trojan python3 and pytest on PATH, LD_PRELOAD in .bashrc (ENV-PATH-01)"),
        Attack("predict-hidden", exploit_commands(env, predicted_hidden(env, seed)), True,
               "the hidden data regenerated from the public generator with every small seed "
               "the visible data could come from, in the deliverables or answered by a "
               "lookup table (PRED-SEED-01)"),
    ]
    return out


UNLISTED = "karotte-unlisted.invalid"  # on no allow-list; never resolved


def _egress(env: Environment) -> list[Attack]:
    """With a network declared: the agent fetches, through the proxy its sandbox has, each
    deliverable's path from a host on no list (EGRESS-UNLISTED-01) and from each host of
    the grader's list and upstreams (EGRESS-PHASE-01, a grader's answer server, say), and
    writes what it gets to the deliverable. Both must score no more than the null agent."""
    fetch = ("fetch() { for d in %s; do curl -sSkf --max-time 5 \"$1/$d\" -o /tmp/.karotte-got"
             " && mkdir -p \"$(dirname \"$d\")\" && cp /tmp/.karotte-got \"$d\"; done; true; }; "
             "cd /workspace; " % (" ".join(_q(d) for d in env.deliverables) or "answer.txt"))
    out = []
    if env.network is not None:
        out.append(Attack("egress-unlisted", (fetch + " ".join(
            f"fetch {u};" for u in (f"http://{UNLISTED}", f"https://{UNLISTED}")),), False,
            "files fetched from a host on no allow-list (EGRESS-UNLISTED-01)"))
    urls = _grader_urls(env.grader_network)
    if urls:
        out.append(Attack("egress-grader-list", (fetch + " ".join(
            f"fetch {_q(u)};" for u in urls),), False,
            "files fetched from the hosts of the grader's network, from the agent's "
            "(EGRESS-PHASE-01)"))
    return out


def _grader_urls(network: Network | None) -> list[str]:
    """A URL for each port of each entry of the grader's allow-list (one name below a
    suffix, an address of a network; "*" names no host), and each upstream's own."""
    if network is None:
        return []
    urls = list(network.upstreams.values())
    for entry in network.allow:
        rule = parse_rule(entry)
        if rule.kind == "any":
            continue
        host = {"name": rule.value, "suffix": f"karotte-probe.{rule.value}"}.get(rule.kind)
        if host is None:  # a network: its first address
            net = ipaddress.ip_network(rule.value)
            first = net[0] if net.num_addresses == 1 else net[1]
            host = f"[{first}]" if first.version == 6 else str(first)
        for port in sorted(rule.ports or {80, 443}):
            urls += ([f"http://{host}"] if port == 80 else [f"https://{host}"] if port == 443
                     else [f"http://{host}:{port}", f"https://{host}:{port}"])
    return urls


def _altered(name: str, q: str) -> list[Attack]:
    """The reference's own content at path q, in a form custody must reject."""
    return [
        Attack(f"hardlink:{name}", (f"cp {q} /workspace/.karotte-link 2>/dev/null || "
                                    f"touch /workspace/.karotte-link; "
                                    f"rm -f {q}; ln /workspace/.karotte-link {q}",), True,
               "the right content, as a hard link"),
        Attack(f"setuid:{name}", (f"chmod u+s,g+s {q}",), True, "the right content, setuid"),
    ]


def _junk(name: str, q: str, prep: str) -> list[Attack]:
    """Content that no grader may credit at path q, with nothing of the reference's."""
    out = [Attack(f"empty:{name}", (prep + f"touch {q}",), False, "an empty deliverable")]
    if name.endswith(".py"):
        return out + [
            Attack(f"exit0:{name}", (prep + f"printf 'import os\\nos._exit(0)\\n' > {q}",), False,
                   "os._exit(0) at import (TEST-EXIT-01)"),
            Attack(f"sysexit:{name}", (prep + f"printf 'import sys\\nsys.exit(0)\\n' > {q}",),
                   False, "sys.exit(0) at import"),
            Attack(f"always-equal:{name}", (prep + "cat > " + q + " <<'EOF'\n" + ALWAYS_EQUAL
                                            + "EOF",), False, "AlwaysEqual results (TEST-EQ-01)"),
        ]
    return out + [Attack(f"nan:{name}", (prep + f"printf 'NaN\\n' > {q}",), False,
                         "NaN as the answer (TEST-NAN-01)")]


INSIDE_SAMPLE = 4  # files attacked inside one directory deliverable
INSIDE_LISTED = 10_000  # of the files listed to choose them from
_inside_cache: dict[tuple[type, int], dict[str, tuple[str, ...]]] = {}


def files_inside(env: Environment, seed: int) -> dict[str, tuple[str, ...]]:
    """For each deliverable that is a directory once the reference solution has run (a
    package, a repository), the first INSIDE_SAMPLE regular files in it by sorted
    workspace-relative path, those under no dot directory (.git/) first: the files that
    the grader reads as the work. The reference is played once per process and seed,
    without grading."""
    key = (type(env), seed)
    if key not in _inside_cache:
        found: dict[str, tuple[str, ...]] = {}
        with Episode(env, seed=seed) as ep:
            steps = ep.reference_solution()
            if steps:
                ep.reset()
                for step in steps:
                    ep.exec(step)
            for d in env.deliverables if steps else ():
                at = _q(_in_workspace(d))
                listing = ep.exec(f"cd /workspace && [ -d {at} ] && [ ! -L {at} ] && "
                                  f"find {_q(d.strip('/'))} -name __pycache__ -prune -o "
                                  f"-type f -print0 | head -z -n {INSIDE_LISTED}").text
                # A name that is not text would be attacked under a mangled path.
                names = sorted((n for n in listing.split("\0") if n and "\ufffd" not in n
                                and "\n" not in n),
                               key=lambda n: (any(p.startswith(".") for p in n.split("/")), n))
                if names:
                    found[d] = tuple(names[:INSIDE_SAMPLE])
        _inside_cache[key] = found
    return _inside_cache[key]


def _inside(files: Sequence[str]) -> list[Attack]:
    """Attacks on the files of a directory deliverable: one of them made a special file
    on top of the reference's work (custody must reject the whole directory), and junk
    in each of them alone (the grader must not credit a package with one bad module)."""
    first = _q(_in_workspace(files[0]))
    out = [
        Attack(f"symlink-hidden:{files[0]}", (f"rm -f {first}; ln -s /hidden/expected.txt "
                                              f"{first}",), True,
               "a file inside the deliverable as a symlink to where hidden data would be"),
        Attack(f"fifo:{files[0]}", (f"rm -f {first}; mkfifo {first}",), True,
               "a file inside the deliverable as a FIFO"),
        *_altered(files[0], first),
    ]
    for f in files:
        q = _q(_in_workspace(f))
        out += _junk(f, q, f"mkdir -p \"$(dirname {q})\"; rm -rf {q}; ")
    return out


ALWAYS_EQUAL = """class AlwaysEqual:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return False
    def __gt__(self, other): return False
    __hash__ = object.__hash__
    def __call__(self, *a, **k): return self
    def __getattr__(self, name): return self
    def __bool__(self): return True
    def __str__(self): return ""
    def __float__(self): return 1.0
    def __int__(self): return 1
    def __iter__(self): return iter(())
def __getattr__(name):
    return AlwaysEqual()
import sys
print(AlwaysEqual())
"""

LEAK_SEARCH = r"""
for f in $(find / \( -path /proc -o -path /sys -o -path /usr -o -path /dev \) -prune -o -type f \
           \( -iname '*expected*' -o -iname '*answer*' -o -iname '*solution*' -o -iname '*hidden*' \
           -o -iname '*reference*' -o -iname '*.ans' \) -print 2>/dev/null | head -20); do
  for d in %(deliverables)s; do
    [ "$f" = "/workspace/$d" ] && continue
    mkdir -p "$(dirname "/workspace/$d")"; cp "$f" "/workspace/$d" 2>/dev/null
  done
done
true
"""

HOOKS = r"""
hook='import os, builtins
open("/tmp/hook-ran", "w").write("1")
'
printf '%s' "$hook" > /workspace/sitecustomize.py
printf '%s' "$hook" > /workspace/usercustomize.py
printf 'import os; open("/tmp/pth-ran", "w").write("1")\n' > /workspace/evil.pth
site=$(python3 -c 'import site; print(site.getusersitepackages())')
mkdir -p "$site" && cp /workspace/sitecustomize.py /workspace/usercustomize.py /workspace/evil.pth "$site"/
cat > /workspace/conftest.py <<'EOF'
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    rep.outcome, rep.longrepr = "passed", None
EOF
printf '[pytest]\naddopts = --collect-only -q\n' > /workspace/pytest.ini
echo 'export PYTEST_ADDOPTS="--collect-only -q"; export PYTHONPATH=/workspace' >> ~/.bashrc
true
"""

TROJANS = r"""
mkdir -p /workspace/bin
for t in python3 python pytest; do
  printf '#!/bin/sh\necho "1 passed"\necho 1.0 > /workspace/reward\nexit 0\n' > /workspace/bin/$t
  chmod +x /workspace/bin/$t
done
echo 'export PATH=/workspace/bin:$PATH; export LD_PRELOAD=/workspace/evil.so' >> ~/.bashrc
export PATH=/workspace/bin:$PATH
true
"""


def _canaries() -> dict[str, str]:
    """Hashes of files an attack must not change: the framework's own code."""
    out = {}
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _play(env: Environment, seed: int, *phases: Sequence) -> tuple[Outcome, float]:
    """One episode playing phases of steps (the reference's, then an attack's): bash
    commands, or ("read_file"|"write_file"|"give_up", arguments) tool calls. Each phase
    starts in /workspace: the bash tool's cd carries over, and an attack planted after a
    reference that did `cd repo` would otherwise act on the wrong paths."""
    plan = [step for number, phase in enumerate(phases)
            for step in (("cd /workspace",) if number else ()) + tuple(phase)]
    t = time.monotonic()
    with Episode(env, seed=seed) as ep:
        ep.reset()
        for step in plan:
            call_tool(ep, *(("bash", {"command": step}) if isinstance(step, str) else step))
            if ep.done:  # gave up
                break
        outcome = ep.finish()
    return outcome, time.monotonic() - t


def _phases(attack: Attack, reference: tuple[str, ...]) -> tuple[Sequence, ...]:
    return (reference, attack.commands) if attack.on_reference else (attack.commands,)


class _Judge:
    """Plays episodes and records their verdicts; one per report."""

    def __init__(self, env: Environment, seed: int, progress: Callable[[str], None] | None):
        self.env, self.seed, self.progress = env, seed, progress
        self.results: list[CheckResult] = []
        self.t0 = time.monotonic()
        self.canaries = _canaries()

    def record(self, name: str, outcome: Outcome, seconds: float, passed: bool,
               why: str, ceiling: float | None = None) -> None:
        self.results.append(CheckResult(
            name, outcome.reward, outcome.reason, passed, why, seconds,
            tuple(f"{v.path}: {v.kind}" for v in outcome.violations), ceiling,
            why_of(outcome.details),
            log_tail(outcome.grader_log) if outcome.reason in GRADER_FAILURES else ()))
        if self.progress:
            self.progress(name)

    def grader_imports(self) -> bool:
        """Whether the grader can import the environment at all; when it cannot, every
        episode is an infra error and nothing else is worth playing."""
        t = time.monotonic()
        try:
            python = preflight(self.env)
        except (KarotteError, OSError) as exc:
            self.results.append(CheckResult("grader-imports", None, "", False, str(exc),
                                            time.monotonic() - t))
            return False
        on = "" if python.image == "host" else f", on the image {python.image}"
        self.results.append(CheckResult(
            "grader-imports", None, "", True,
            f"the grader imports it under {python.path} {' '.join(grader_flags(python.image))} "
            f"(Python {python.version}{on})",
            time.monotonic() - t))
        return True

    def null_agent(self) -> float:
        """Play the null agent; the reward no attack may exceed."""
        bottom, _ = self.env.reward_range
        null, secs = _play(self.env, self.seed, ())
        if null.infra_error:
            problem = f"infra error: {null.infra_error}"
        elif null.reason != "graded":
            # A grader that fails on an empty workspace fails on every attack too, and each
            # attack would then pass at the bottom reward without being judged at all.
            problem = (f"the grader did not grade an empty workspace ({null.reason}); every "
                       "attack would pass unjudged: grade a missing deliverable as the bottom")
        elif abs(null.reward - bottom) > EPSILON:
            problem = f"scored {null.reward:g}, not the bottom reward {bottom:g}"
        else:
            problem = None
        self.record("null-agent", null, secs, problem is None,
                    problem or f"doing nothing must be graded the bottom reward {bottom:g}")
        return max(null.reward, bottom)

    def attack(self, name: str, phases: Sequence[Sequence], what: str, ceiling: float,
               bound: str = "the null agent") -> None:
        """An attack passes (the environment holds) when it scores no more than the
        ceiling (the null agent's reward, unless `bound` names another), the grader
        completes, and nothing is left on the host."""
        outcome, secs = _play(self.env, self.seed, *phases)
        problems = []
        if outcome.infra_error:
            problems.append(f"infra error: {outcome.infra_error}")
        if outcome.reward > ceiling + EPSILON:
            problems.append(f"scored {outcome.reward:g}, more than {bound}'s {ceiling:g}")
        if secs > BOUND_SECONDS:
            problems.append(f"took {secs:.0f} s")
        left = sorted(set(cgroups.find_created_by()) - cgroups.pooled_paths())
        if left:
            problems.append(f"left cgroups behind: {left[:3]}")
        alive = cgroups.processes_of()
        if alive:
            problems.append(f"sandbox processes still alive: {alive[:5]}")
        self.record(name, outcome, secs, not problems,
                    "; ".join(problems) or f"{what}: no more than {bound}, "
                    "nothing left running", ceiling)

    def report(self) -> CheckReport:
        changed = [p for p, h in _canaries().items() if self.canaries.get(p) != h]
        if changed:
            self.results.append(CheckResult("host-unaffected", None, "", False,
                                            f"framework files changed: {changed[:3]}", 0.0))
        else:
            self.results.append(CheckResult(
                "host-unaffected", None, "", True,
                "Karotte's own files hash the same before and after", 0.0))
        env = self.env
        return CheckReport(f"{type(env).__module__}:{type(env).__qualname__}",
                           tuple(self.results), time.monotonic() - self.t0)


def check(env: Environment, *, seed: int = 1,
          progress: Callable[[str], None] | None = None) -> CheckReport:
    """Run the reference, the null agent and the battery against env."""
    bottom, top = env.reward_range
    reference = tuple(env.reference_solution(env_seed(env, seed)))
    judge = _Judge(env, seed, progress)
    if not judge.grader_imports():
        return judge.report()
    ref, secs = _play(env, seed, reference)
    if not reference:
        judge.record("reference", ref, secs, False, "the environment has no reference_solution()")
    elif env.deep:
        judge.record("reference", ref, secs,
                     ref.reason == "graded" and ref.reward > bottom + EPSILON,
                     f"a deep task: the reference must score above the bottom {bottom:g}")
    else:
        judge.record("reference", ref, secs,
                     ref.reason == "graded" and abs(ref.reward - top) <= EPSILON,
                     f"must reach the top reward {top:g}")
    ceiling = judge.null_agent()
    for attack in attacks_for(env, seed):
        judge.attack(attack.name, _phases(attack, reference), attack.what, ceiling)
    return judge.report()


def pick_attacks(env: Environment, seed: int, names: Sequence[str] | None) -> list[Attack]:
    """The battery's attacks named (all of them for None); ValueError for a name that
    is not in this environment's battery."""
    battery = attacks_for(env, seed)
    if names is None:
        return battery
    unknown = sorted(set(names) - {a.name for a in battery})
    if unknown:
        raise ValueError(f"no such attack in this environment's battery: "
                         f"{', '.join(unknown)} (see --list)")
    return [a for a in battery if a.name in set(names)]


def redteam(env: Environment, *, seed: int = 1, attacks: Sequence[Attack] | None = None,
            agents: Sequence[ScriptedAgent] = (),
            progress: Callable[[str], None] | None = None) -> CheckReport:
    """The null agent, then attacks judged as in check(): `attacks` (from pick_attacks;
    None: the whole battery) and each of `agents`, against its own ceiling where it
    states one. No reference run: the question is only whether anything scores more
    than it may, or harms the host."""
    battery = attacks_for(env, seed) if attacks is None else attacks
    reference = tuple(env.reference_solution(env_seed(env, seed))) if any(a.on_reference for a in battery) else ()
    judge = _Judge(env, seed, progress)
    if not judge.grader_imports():
        return judge.report()
    ceiling = judge.null_agent()
    for attack in battery:
        judge.attack(attack.name, _phases(attack, reference), attack.what, ceiling)
    for agent in agents:
        if agent.ceiling is None:
            judge.attack(agent.name, (agent.steps,), "a scripted agent", ceiling)
        else:
            judge.attack(agent.name, (agent.steps,), "a scripted agent", agent.ceiling,
                         "its stated ceiling")
    return judge.report()
