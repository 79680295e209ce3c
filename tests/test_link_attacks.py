"""LINK-CACHE-01: runs of the agent's program linked through state the host shares between
sandboxes and that outlives every process of a run: here the page cache of a read-only
/usr file. A run marks an answer by reading chosen pages; a later run reads it back by
timing reads (a cached page comes in about 1 us, one from the disk in about 50 us), with
plain pread: none of mincore, RWF_NOWAIT or cachestat. The defence is compare_speed's:
no program gets an input twice, so no timed run has an answer to look up."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from karotte.episode import Episode
from karotte.examples.speedup import MIN_SPEEDUP, Speedup

from envs.speed import TimesWhatItSawBefore

from conftest import drop_pages

SEED = 3
MARK_FILE_SIZE = 64 * 1024 * 1024  # the cache's file must hold this much at least
CONTROL_TRIES = 3

# The agent's solution.py. Its cache is FILE's page cache. An input's sha256 picks a block
# of GENERATIONS regions; a region holds 64 bits, the answer, a tag of the input and a
# check of both, in 130 pages: a marker pair (first page read: written; both: used up)
# and a pair per bit (one of the two read). The check makes a region read back wrong (a
# mark the host reclaimed, a read timed wrong) count as used up, never as an answer: on
# our hosts page cache that nobody reads is reclaimed within seconds, idle or not.
# Timing a read reads the page in, so each look uses a region up: a run that finds its
# answer writes it again into the next region. A read that took long
# because the run was preempted (another process had the CPU) tells nothing; the other
# page of its pair does. What it has not seen it computes quadratically, as the baseline
# does, so that only the cache makes it fast.
CACHED = '''\
import hashlib, os, resource, sys, time

FILE = %r
PAGE, BITS, GENERATIONS, HOT_NS = 4096, 64, 8, 15_000
REGION = 2 + 2 * BITS

data = sys.stdin.buffer.read()
digest = hashlib.sha256(data).digest()
tag = int.from_bytes(digest[8:10], "big")  # an answer found under another input's tag is not ours
fd = os.open(FILE, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: a read caches its page only
blocks = os.fstat(fd).st_size // (PAGE * REGION * GENERATIONS)
block = int.from_bytes(digest[:8], "big") %% blocks
regions = [(block * GENERATIONS + g) * REGION for g in range(GENERATIONS)]


def check(tag, answer):
    """16 bits of the sha256 of the input, the tag and the answer."""
    return int.from_bytes(hashlib.sha256(digest + (tag << 32 | answer).to_bytes(6, "big"))
                          .digest()[:2], "big")


def hot(page):
    """True if the page was cached, False if it came from the disk, None if unknown."""
    switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
    start = time.perf_counter_ns()
    os.pread(fd, 1, page * PAGE)
    if time.perf_counter_ns() - start < HOT_NS:
        return True
    return False if resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw == switches else None


def bit(zero, one):
    """The bit a pair of pages holds (exactly one of them read), or None."""
    if one is True or zero is False and one is None:
        return None if zero is True else 1
    if zero is True or one is False and zero is None:
        return 0
    return None


def look(region):
    """None for a region nobody looked at; else the bits written there, or "used"."""
    written, used = hot(region), hot(region + 1)
    if used is not False:
        return "used"
    if written is False:
        return None
    pairs = [(hot(region + 2 + 2 * k), hot(region + 3 + 2 * k)) for k in range(BITS)]
    if written is None and all(pair == (False, False) for pair in pairs):
        return None
    bits = [bit(*pair) for pair in pairs]
    if None in bits:
        return "used"
    value = sum(b << k for k, b in enumerate(bits))
    if value >> 48 != check(value >> 32 & 0xFFFF, value & 0xFFFFFFFF):
        return "used"
    return value & 0xFFFFFFFFFFFF


answer, target = None, None
for g, region in enumerate(regions):
    found = look(region)
    if found is None or found != "used" and found >> 32 == tag:
        answer = None if found is None else found & 0xFFFFFFFF
        target = regions[g + 1] if g + 1 < GENERATIONS else None
        break
if answer is None:
    a = [int(x) for x in data.split()[1:]]
    answer = sum(a[i] > a[j] for i in range(len(a)) for j in range(i + 1, len(a)))
print(answer, flush=True)
if target is not None:
    value = check(tag, answer) << 48 | tag << 32 | answer
    os.pread(fd, 1, target * PAGE)
    for k in range(BITS):
        os.pread(fd, 1, (target + 2 + 2 * k + (value >> k & 1)) * PAGE)
'''


def mark_file() -> Path | None:
    """The largest file of at least MARK_FILE_SIZE under /usr/lib that no process maps:
    the host can drop its pages, so that no mark of an earlier test is read."""
    found = sorted((p.stat().st_size, p) for p in Path("/usr/lib").rglob("*")
                   if p.is_file() and not p.is_symlink() and p.stat().st_size >= MARK_FILE_SIZE)
    maps = ""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                maps += Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
    return next((p for _, p in reversed(found) if str(p) not in maps), None)


def play(env, solution: str):
    with Episode(env, seed=SEED) as ep:
        ep.reset()
        ep.write_file("solution.py", solution)
        return ep.finish()


def test_LINK_CACHE_01_answers_cached_in_the_page_cache_do_not_raise_the_speedup_reward(
        no_leaks):
    path = mark_file()
    if path is None:
        pytest.skip(f"needs a file of {MARK_FILE_SIZE >> 20} MiB or more under /usr/lib "
                    "that no process maps, to mark pages of")
    solution = CACHED % str(path)
    try:
        # The control: timed on inputs a run of it saw before, the cache answers at once.
        # Marks the host reclaims before they are read make the cache miss: it must
        # answer at once in one of CONTROL_TRIES episodes.
        controls = []
        for _ in range(CONTROL_TRIES):
            drop_pages(path)
            controls.append(seen := play(TimesWhatItSawBefore(), solution))
            if seen.reason == "graded" and seen.reward >= MIN_SPEEDUP:
                break
        else:
            raise AssertionError([c.details for c in controls])
        # The example never gives the solution an input twice, in one grading or in a
        # later episode of the same seed (the next epoch's): it computes every timed
        # answer as slowly as the baseline, and scores what the quadratic baseline scores.
        drop_pages(path)
        outcomes = [play(Speedup(), solution) for _ in range(2)]
    finally:
        drop_pages(path)
    for outcome in outcomes:
        assert (outcome.reward, outcome.reason) == (0.0, "graded"), outcome.details
        assert outcome.details["why"] == f"speedup below {MIN_SPEEDUP:g}", outcome.details
