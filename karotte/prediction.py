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
the same for two seeds far apart (they depend on no seed). exploit_commands() turns the
prediction into an agent's bash commands, planted after the reference solution:

- a deliverable that is a program (a .py file or an executable) is run, in the agent's
  own sandbox, on each predicted hidden file and each of its lines as stdin, and is
  replaced by a lookup table: a program that prints the recorded output for an input
  whose sha256 it knows, and fails on any other;
- another file deliverable gets the content of a predicted hidden file (the one of the
  same name, else of the same suffix, else the first);
- a directory deliverable is removed: the reference's work must not score for it.

So the attack scores only with what it predicted. It cannot find a hidden stream that
continues a visible one (the Mersenne Twister's state follows from 624 of its outputs),
nor a seed space too large to walk (`seed % 2**32`): docs/examples.md says how a
generator avoids those.
"""
from __future__ import annotations

import base64
import hashlib
import json
import shlex
from typing import Mapping

from .environment import Environment, File
from .seeding import env_seed

PREDICT_SEEDS = 1024  # small seeds tried: a trainer's 0, 1, 2, ..., and `seed % 1000`
PREDICT_MATCHES = 8  # seeds whose visible data match, at most, whose hidden data are used
PROBE_SEEDS = (2 ** 62 + 1, 2 ** 61 + 3)  # hidden files the same for both depend on no seed
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


def predicted_hidden(env: Environment, seed: int) -> tuple[tuple[str, bytes], ...]:
    """(path, content) of each hidden file an agent could regenerate for the episode of
    the trainer's `seed`, distinct contents only: see the module's docstring. Made once
    per environment class and seed (and key) in a process."""
    shown_seed = env_seed(env, seed)
    key = (type(env), seed, shown_seed)
    if key in _cache:
        return _cache[key]
    # What the agent reads in the episode, and nothing more.
    prompt, files = env.prompt(shown_seed), _files(env, shown_seed)
    found: dict[bytes, str] = {}
    matched = 0
    for guess in dict.fromkeys((seed, *range(PREDICT_SEEDS))):
        # A generator that fails on a guess (one that assumes a large seed) shows
        # nothing for it: that guess cannot be the episode's.
        try:
            if env.prompt(guess) != prompt or _files(env, guess) != files:
                continue
            hidden = _hidden(env, guess)
        except Exception:
            continue
        for path, data in hidden.items():
            found.setdefault(data, path)
        matched += 1
        if matched == PREDICT_MATCHES:
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
    p = os.path.join("/workspace", d.strip("/"))
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
