#!/usr/bin/env python3
"""How long AsyncEpisodes hold up the event loop they share with a trainer.

    scripts/bench_loop_stall.py [--episodes N] [--concurrency K] [--rounds R]
                                [--attribute] [--json FILE]

N AsyncEpisodes (default 100) of the AnswerFile task (scripts/bench_envs.py) run from one
event loop, at most K at once (default 64, the library's default): reset, two bash-tool
calls, finish (graded, whatever the reward). Next to them a ticker task sleeps 1 ms at a time and records by how much
each wake-up came late: the gaps a trainer's own tasks (model requests, heartbeats) would
see. Reported per round: the longest gap, the p99 and the median, and the episodes'
wall time. Any gap is work done on the loop's thread; blocking work belongs in a thread.

--attribute runs asyncio's debug mode (slow_callback_duration 20 ms) and lists which
coroutine steps took longest on the loop. Debug mode slows everything: the gaps of an
attributed round are not the ones to quote.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import statistics
import sys
import time

import benchlib  # noqa: F401 - before karotte: it puts this checkout's karotte on sys.path
import bench_envs
from karotte.episode import AsyncEpisode, set_concurrency

TICK = 0.001
ENV = bench_envs.AnswerFile()


async def _episode(seed: int) -> float:
    async with AsyncEpisode(ENV, seed=seed) as ep:
        await ep.reset()
        await ep.exec("true")
        await ep.exec("cat numbers.txt > answer.txt")
        outcome = await ep.finish()
    if outcome.reason != "graded":
        raise RuntimeError(f"episode {seed}: {outcome.reason} {outcome.infra_error or ''}")
    return outcome.reward


async def _round(episodes: int) -> dict:
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            t = loop.time()
            await asyncio.sleep(TICK)
            gaps.append(loop.time() - t - TICK)

    tick = asyncio.create_task(ticker())
    t0 = time.monotonic()
    try:
        await asyncio.gather(*(_episode(seed) for seed in range(episodes)))
    finally:
        stop.set()
        await tick
    wall = time.monotonic() - t0
    gaps.sort()
    return {"episodes": episodes, "wall_s": wall, "ticks": len(gaps),
            "max_gap_ms": gaps[-1] * 1000, "p99_gap_ms": gaps[int(len(gaps) * 0.99)] * 1000,
            "median_gap_ms": statistics.median(gaps) * 1000}


class _SlowSteps(logging.Handler):
    """Collects asyncio debug mode's 'Executing <...> took X seconds' lines."""

    PATTERN = re.compile(r"Executing (.*) took (\d+\.\d+) seconds")

    def __init__(self):
        super().__init__()
        self.steps: dict[str, list[float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        m = self.PATTERN.search(record.getMessage())
        if m:
            where = re.sub(r" at 0x[0-9a-f]+|wait_for=<[^>]*>|cb=\[[^\]]*\]", "", m.group(1))
            where = re.sub(r"<Task pending name='Task-\d+' ", "<Task ", where)
            self.steps.setdefault(where[:160], []).append(float(m.group(2)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attribute", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    set_concurrency(args.concurrency)
    rounds = []
    for i in range(args.rounds):
        r = asyncio.run(_round(args.episodes))
        rounds.append(r)
        print(f"round {i + 1}: {r['episodes']} episodes in {r['wall_s']:.1f} s; loop gaps: "
              f"max {r['max_gap_ms']:.0f} ms, p99 {r['p99_gap_ms']:.1f} ms, "
              f"median {r['median_gap_ms']:.2f} ms ({r['ticks']} ticks)")
    slow = None
    if args.attribute:
        handler = _SlowSteps()
        logging.getLogger("asyncio").addHandler(handler)
        logging.getLogger("asyncio").setLevel(logging.WARNING)

        async def attributed() -> dict:
            asyncio.get_running_loop().slow_callback_duration = 0.02
            return await _round(args.episodes)

        asyncio.run(attributed(), debug=True)
        slow = sorted(((max(v), len(v), k) for k, v in handler.steps.items()), reverse=True)
        print("steps on the loop over 20 ms (debug mode), longest first:")
        for longest, count, where in slow[:15]:
            print(f"  {longest * 1000:6.0f} ms  x{count:<4} {where}")
    print(f"longest gap of all rounds: {max(r['max_gap_ms'] for r in rounds):.0f} ms "
          f"(cores {len(os.sched_getaffinity(0))}, load {os.getloadavg()[0]:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "slow_steps": slow}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
