"""PRED-SEED-01: the hidden data an agent could predict instead of earning, for `karotte check`.

An environment's generator is public. If the seed it is given can be told from what the
agent sees, the agent can run that generator for the hidden data: the answers, the
hidden test inputs. Karotte gives environments a keyed 63-bit seed (karotte/seeding.py),
so this works only where the environment itself throws the seed away: it reduces it
(`seed % 1000`), or its hidden data do not depend on it at all.

predicted_hidden() plays that agent. It tries every seed it could guess, the trainer's
seed and 0..PREDICT_SEEDS-1, each passed to the environment as an unkeyed framework
would, and keeps those whose prompt and workspace files are exactly what the episode
shows; their hidden files are its prediction, together with the hidden files that are
the same for two seeds far apart (they depend on no seed). When no small seed matches, it
looks for a seed space that is still small enough for an agent to walk (`seed % 100000`):
two of SPACE_PROBES large seeds, or one and a small seed, that give the same visible and
the same hidden data. Then it walks on from PREDICT_SEEDS, as such an agent would, for
at most WALK_SECONDS. exploit_commands() turns the prediction into an agent's bash
commands, planted after the reference solution:

- a deliverable that is a program (a .py file or an executable) is run, in the agent's
  own sandbox, on each predicted hidden file and each of its lines as stdin, and is
  replaced by a lookup table: a program that prints the recorded output for an input
  whose sha256 it knows, and fails on any other;
- another file deliverable gets the content of a predicted hidden file (the one of the
  same name, else of the same suffix, else the first);
- a directory deliverable is removed: the reference's work must not score for it.

So the attack scores only with what it predicted. It cannot find a hidden stream that
continues a visible one (the Mersenne Twister's state follows from 624 of its outputs),
nor a seed space too large to walk in WALK_SECONDS, or too large for SPACE_PROBES seeds to
meet twice in it (about a million: `seed % 2**32`): docs/examples.md says how a generator
avoids those.
"""
from __future__ import annotations

import base64
import hashlib
import json
import random
import shlex
import time
from typing import Mapping

from .environment import Environment, File
from .seeding import env_seed

PREDICT_SEEDS = 1024  # small seeds tried: a trainer's 0, 1, 2, ..., and `seed % 1000`
PREDICT_MATCHES = 8  # seeds whose visible data match, at most, whose hidden data are used
PROBE_SEEDS = (2 ** 62 + 1, 2 ** 61 + 3)  # hidden files the same for both depend on no seed
# PRED-SEED-01 past the small seeds: M seeds reduced to `seed % M` meet, with the same
# visible and hidden data, about (PREDICT_SEEDS + SPACE_PROBES / 2) * SPACE_PROBES / M
# times (6 for M = 100,000), and an agent walks such a space in seconds.
SPACE_PROBES = 512
SPACE_CHECKS = 8  # pairs with the same visible data whose hidden data are compared, at most
WALK_SECONDS = 20.0  # walking on from PREDICT_SEEDS, once a small space is found
WALK_SEEDS = 1 << 24
PREDICTED_BYTES = 8 * 1024 * 1024  # of predicted files planted in the sandbox, at most
CHUNK = 96 * 1024  # characters of the prediction per bash command (an argument: 128 KiB)
PREDICTED = "/tmp/.karotte-predicted.json"

_cache: dict[tuple[type, int, int], tuple[tuple[str, bytes], ...]] = {}


def _files(env: Environment, seed: int) -> dict[str, tuple[bytes, int]]:
    """The workspace an episode whose environment got `seed` starts with: each file's
    bytes and mode."""
    files = {}
    for path, content in env.workspace_files(seed).items():
        f = content if isinstance(content, File) else File(content)
        files[path] = (f.data(), f.mode)
    return files


def _hidden(env: Environment, seed: int) -> dict[str, bytes]:
    return {path: data.encode() if isinstance(data, str) else bytes(data)
            for path, data in env.hidden_files(seed).items()}


def _visible(env: Environment, seed: int, prompt: str | None = None) -> bytes | None:
    """A digest of what an agent reads in an episode whose environment got `seed`: the
    prompt (given, or made here) and the workspace files; None for a seed the generator
    fails on (a guess that assumes a large seed shows nothing: it cannot be the
    episode's)."""
    try:
        prompt, files = env.prompt(seed) if prompt is None else prompt, _files(env, seed)
    except Exception:
        return None
    digest = hashlib.sha256(prompt.encode("utf-8", "surrogatepass"))
    for path in sorted(files):
        data, mode = files[path]
        digest.update(b"\0%s\0%d\0%d\0" % (path.encode("utf-8", "surrogatepass"), mode,
                                             len(data)) + data)
    return digest.digest()


def _same_hidden(env: Environment, a: int, b: int) -> bool:
    try:
        return _hidden(env, a) == _hidden(env, b)
    except Exception:
        return False


def _small_space(env: Environment, seen: dict[bytes, int]) -> bool:
    """Whether the environment's seeds fall into a space an agent could walk: some of
    SPACE_PROBES large seeds show what another seed shows (`seen`: visible digest ->
    seed) and hide the same data. A pair with other hidden data is no sign (a constant
    workspace), and at most SPACE_CHECKS pairs are compared."""
    rng = random.Random("karotte:predict-hidden:space")
    checks = 0
    for _ in range(SPACE_PROBES):
        probe = rng.getrandbits(63)
        mark = _visible(env, probe)
        if mark is None:
            continue
        other = seen.setdefault(mark, probe)
        if other != probe:
            if _same_hidden(env, other, probe):
                return True
            checks += 1
            if checks == SPACE_CHECKS:
                return False
    return False


def predicted_hidden(env: Environment, seed: int) -> tuple[tuple[str, bytes], ...]:
    """(path, content) of each hidden file an agent could regenerate for the episode of
    the trainer's `seed`, distinct contents only: see the module's docstring. Made once
    per environment class and seed (and key) in a process."""
    shown_seed = env_seed(env, seed)
    key = (type(env), seed, shown_seed)
    if key in _cache:
        return _cache[key]
    # What the agent reads in the episode, and nothing more.
    shown_prompt = env.prompt(shown_seed)
    shown = _visible(env, shown_seed, shown_prompt)
    found: dict[bytes, str] = {}
    seen: dict[bytes, int] = {}
    matched = 0

    def guessed(guess: int) -> bool:
        """Take guess's hidden files if its visible data are the episode's; True once
        PREDICT_MATCHES guesses matched."""
        nonlocal matched
        try:
            prompt = env.prompt(guess)
        except Exception:
            return False
        if prompt != shown_prompt:  # the workspace, often the costly part, is not made
            return False
        mark = _visible(env, guess, prompt)
        if mark is None:
            return False
        seen.setdefault(mark, guess)
        if mark != shown:
            return False
        try:
            hidden = _hidden(env, guess)
        except Exception:
            return False
        for path, data in hidden.items():
            found.setdefault(data, path)
        matched += 1
        return matched == PREDICT_MATCHES

    if shown is not None:
        for guess in dict.fromkeys((seed, *range(PREDICT_SEEDS))):
            if guessed(guess):
                break
        if not matched and _small_space(env, seen):
            deadline = time.monotonic() + WALK_SECONDS
            for guess in range(PREDICT_SEEDS, WALK_SEEDS):  # one match tells the class
                guessed(guess)
                if matched or time.monotonic() > deadline:
                    break
    try:
        first, second = (_hidden(env, probe) for probe in PROBE_SEEDS)
    except Exception:
        first, second = {}, {}
    for path, data in first.items():
        if second.get(path) == data:
            found.setdefault(data, path)
    kept, size = [], 0
    for data, path in found.items():
        if size + len(data) <= PREDICTED_BYTES:
            kept.append((path, data))
            size += len(data)
    _cache[key] = tuple(kept)
    return _cache[key]


def exploit_commands(env: Environment, predicted: tuple[tuple[str, bytes], ...]
                     ) -> tuple[str, ...]:
    """Bash commands, run after the reference solution, that put the prediction where
    the grader reads: see the module's docstring."""
    data = json.dumps([[path, base64.b64encode(content).decode()]
                       for path, content in predicted])
    plan = json.dumps({"deliverables": list(env.deliverables), "predicted": PREDICTED,
                       "budget": env.limits.timeout / 2, "lookup": LOOKUP})
    return (f"rm -f {PREDICTED}",
            *(f"printf %s {shlex.quote(data[i:i + CHUNK])} >> {PREDICTED}"
              for i in range(0, len(data), CHUNK)),
            f"python3 -c {shlex.quote(EXPLOIT)} {shlex.quote(plan)}")


# A program that answers only the inputs it knows: "%r" is the JSON of its table, the
# sha256 of an input (hex) to its output (base64).
LOOKUP = """import base64, hashlib, json, sys
TABLE = json.loads(%r)
out = TABLE.get(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())
if out is None:
    sys.exit(1)
sys.stdout.buffer.write(base64.b64decode(out))
"""


def lookup_program(answers: Mapping[bytes, bytes]) -> str:
    """LOOKUP for answers: input -> output."""
    return LOOKUP % json.dumps({hashlib.sha256(data).hexdigest(): base64.b64encode(out).decode()
                                for data, out in answers.items()})


# Runs in the agent's sandbox. argv[1]: {"deliverables", "predicted", "budget", "lookup"}.
EXPLOIT = r'''
import base64, hashlib, json, os, shutil, subprocess, sys, time

plan = json.loads(sys.argv[1])
with open(plan["predicted"]) as f:
    predicted = [(path, base64.b64decode(data)) for path, data in json.load(f)]
stdins = [data for _, data in predicted]
stdins += [line for _, data in predicted if data.count(b"\n") <= 64
           for line in data.splitlines(keepends=True)]
stdins = list(dict.fromkeys(stdins))[:256]
deadline = time.monotonic() + plan["budget"]


def recorded(argv):
    table = {}
    for data in stdins:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            r = subprocess.run(argv, input=data, capture_output=True, cwd="/workspace",
                               timeout=min(10.0, left))
        except (subprocess.TimeoutExpired, OSError):
            continue
        if r.returncode == 0:
            table[hashlib.sha256(data).hexdigest()] = base64.b64encode(r.stdout).decode()
    return table


def chosen(name):
    for fits in (lambda p: os.path.basename(p) == os.path.basename(name),
                 lambda p: os.path.splitext(p)[1] == os.path.splitext(name)[1],
                 lambda p: True):
        for path, data in predicted:
            if fits(path):
                return data
    return None


for d in plan["deliverables"]:
    p = d if d.startswith("/") else os.path.join("/workspace", d.strip("/"))
    if os.path.isfile(p) and not os.path.islink(p) and (p.endswith(".py")
                                                        or os.access(p, os.X_OK)):
        table = recorded([sys.executable, "-I", p] if p.endswith(".py") else [p])
        with open(p, "w") as f:
            f.write(("" if p.endswith(".py") else "#!/usr/bin/python3 -I\n")
                    + plan["lookup"] % json.dumps(table))
        os.chmod(p, 0o755)
        print(f"{d}: a lookup table of {len(table)} predicted inputs")
        continue
    if os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p)
        print(f"{d}: removed (a directory)")
        continue
    if os.path.lexists(p):
        os.remove(p)
    data = chosen(d)
    if data is not None:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
    print(f"{d}: {'a predicted hidden file' if data is not None else 'removed'}")
'''
