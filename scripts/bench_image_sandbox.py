#!/usr/bin/env python3
"""Sandboxes and episodes on an image against the same on the host's userland, side by
side in one run.

    scripts/bench_image_sandbox.py [--quick] [--image REF] [--runs N] [--episodes N]
                                   [--cases a,b] [--json FILE] [--quiet]

The image is REF, by default debian:bookworm+python3: the image tasks are declared on
(Debian's userland, as the examples' debian:bookworm+python3-pytest), the smallest one
whose python3 can run the episode's grader, and one the public API makes in one call
with no file of the benchmark's own: karotte.images.import_image(REF), what `karotte
image build` runs (mmdebstrap from Debian's archive into the store on first use,
$KAROTTE_IMAGE_DIR or the default store; a cache hit after). The run also gives it a
name, NAME below, and removes that name at the end unless it was there before.

Cases (each reports medians with p10/p90, and ratios to the host's userland):

  lifecycle  create + exec /bin/true + destroy, round-robin: on the host's userland; on
             the image by REF, as an Environment declares it; on the image by NAME (the
             store's record is read, nothing written); on its tree as dir:TREE (no store
             and no lease: the overlay and the idmapped tree alone).
  phases     where the difference goes: bench_sandbox.py's phase timers plus the steps
             only an image takes (IMAGE_SANDBOX_PHASES in benchlib.py: resolve_root, the
             store's record and lease, the idmapped tree); the overlay init lays is in
             "wait for READY", shown against the host's. Host, REF and NAME cycles
             alternate. A name that is gone or never called stops the benchmark.
  episode    bench_episode.py's minimal episode (bench_envs.AnswerFile, the agent runs
             `true`), by phase, on the host's userland and with the environment's image
             set to REF and to NAME (the grader then runs under the image's python3),
             taking turns.

Where the image cannot be had or run on here (no mmdebstrap, no network to Debian's
archive, a kernel without overlayfs in a user namespace), its series are skipped with
the reason, never given a number.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass

from benchlib import (EPISODE_PHASES, IMAGE_SANDBOX_PHASES, Goal, PhaseTimer, Series, Stats, fmt_ms,
                      karotte_line, load_line, machine_line, render_cases_and_goals)
from benchlib import main as bench_main
from bench_peers import TRUE, Competitor, PeerFailed
from bench_sandbox import (KarotteLifecycle, instrumented_cycle, phase_table, race,
                           reach_every_phase)
import bench_envs
import bench_episode
from karotte import images
from karotte.errors import KarotteError
from karotte.sandbox import Sandbox
from karotte.spec import SandboxSpec

CASES = ("lifecycle", "phases", "episode")
DEFAULT_IMAGE = "debian:bookworm+python3"
NAME = "karotte-bench/image-sandbox"
HOST, BY_REF, BY_NAME, BY_DIR = ("host userland", "image by reference", "image by name",
                                 "image tree as dir:")

GOAL_RATIO = 1.2  # create + exec + destroy on an image within 1.2x of the host's userland
GOAL_EPISODE_MS = bench_episode.GOAL_EPISODE_MS  # a minimal episode, on an image too


# --------------------------------------------------------------------------- the image

@dataclass(frozen=True)
class BenchImage:
    """The image measured: how it is referred to, and what getting it cost this run."""

    ref: str
    name: str
    tree: str
    size: int  # bytes of the tree's regular files
    get_seconds: float  # import_image(ref) in this run: a build, or a cache hit
    built: bool  # this run unpacked it (mmdebstrap or an import), no cache hit
    named_here: bool  # NAME was made by this run (and is removed at its end)


def get_image(ref: str, log) -> tuple[BenchImage | None, str | None]:
    """The image of ref in the default store, named NAME; or None and why not."""
    store = images.default_store()
    log(f"  image: import_image({ref!r}) into {store.root} (mmdebstrap on first use)")
    t0 = time.perf_counter()
    try:
        image = store.import_image(ref)
        seconds = time.perf_counter() - t0
        try:
            store.inspect(NAME)
            named_here = False
        except images.ImageNotFound:
            named_here = True
        store.import_image(ref, name=NAME)
    except KarotteError as exc:
        return None, f"the image {ref} cannot be had here: {exc}"
    return BenchImage(ref, NAME, image.tree, image.size, seconds, store.extractions > 0,
                      named_here), None


def drop_name(image: BenchImage | None) -> None:
    """The store as it was: NAME removed if this run made it (its tree stays, a cache)."""
    if image is not None and image.named_here:
        images.default_store().rm(image.name)


def image_specs(image: BenchImage | None) -> dict[str, SandboxSpec | None]:
    """The spec of each series; None where there is no image."""
    on = (lambda ref: SandboxSpec(image=ref)) if image else (lambda ref: None)
    return {HOST: SandboxSpec(), BY_REF: on(image and image.ref),
            BY_NAME: on(image and image.name), BY_DIR: on(image and f"dir:{image.tree}")}


class OnImage(KarotteLifecycle):
    """KarotteLifecycle on an image: skipped, with the reason, where there is none or a
    sandbox on it cannot start here."""

    def __init__(self, spec: SandboxSpec | None, name: str, describe: str, why: str | None):
        super().__init__(spec or SandboxSpec(), name, describe)
        self.why = None if spec is not None else why

    def prepare(self) -> str | None:
        if self.why is not None:
            return self.why
        try:
            with Sandbox(self.spec) as sb:
                sb.exec([TRUE])
        except KarotteError as exc:
            return f"a sandbox on {self.spec.image} cannot start here: {exc}"
        return None

    def run_once(self) -> int:
        try:
            return super().run_once()
        except KarotteError as exc:
            raise PeerFailed(str(exc)) from exc


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


# --------------------------------------------------------------------------- case 1

def case_lifecycle(image: BenchImage | None, why: str | None, runs: int, warmup: int,
                   log) -> dict:
    specs = image_specs(image)
    what = {
        HOST: "Sandbox(SandboxSpec()) + exec /bin/true + close: the host's userland",
        BY_REF: f"the same with image={image and image.ref!r}: the store's record of the "
                "source read, the tree leased, idmapped, the overlay",
        BY_NAME: f"the same with image={NAME!r}: the record read by name",
        BY_DIR: "the same with image='dir:' + the store's tree: no store, no lease",
    }
    competitors: list[Competitor] = [KarotteLifecycle(specs[HOST], HOST, what[HOST])]
    competitors += [OnImage(specs[v], v, what[v], why) for v in (BY_REF, BY_NAME, BY_DIR)]
    series = race(competitors, runs, warmup, log)
    host = series[HOST].median_ms
    return {"runs": runs, "warmup": warmup,
            "series": [s.to_json() for s in series.values()],
            "over_host": {v: _ratio(s.median_ms, host) for v, s in series.items() if v != HOST}}


# --------------------------------------------------------------------------- case 2

PHASE_VARIANTS = (HOST, BY_REF, BY_NAME)
_IMAGE = list(IMAGE_SANDBOX_PHASES)
# The rows of case 2 in the order of a creation, and how deep each nests: a line's time
# includes the deeper lines under it (labels of the tables in benchlib.py, and those
# bench_sandbox.phase_run derives).
PHASE_DEPTH = {
    "create: total": 0, "create: whole start() before waiting": 1,
    _IMAGE[0]: 2, _IMAGE[1]: 3, _IMAGE[2]: 4, _IMAGE[3]: 3,
    "create: cgroup from the pool or new, limits written (acquire)": 2,
    "create: cgroup backend probe (detect)": 3, "create: cgroup name (leaf_name)": 3,
    "create: cgroup mkdir + limits (create, when the pool is empty)": 3,
    "create: clone3 of init, from a thread in the sandbox's cgroup (spawn_init)": 2,
    "create: uid/gid maps (_write_proc)": 2, "create: send GO + CONFIG": 2,
    _IMAGE[4]: 2, "create: config message build": 3, _IMAGE[5]: 3, _IMAGE[6]: 4,
    "create: wait for READY (init exec + mount tree)": 1, "create: READY receive": 1,
    "create: finish_start": 1,
    "first exec: total": 0, "exec: begin_exec (cgroup peak reset, oom count, pipes, send)": 1,
    "exec: wait for exit (drive_sync)": 1, "exec: end_exec (cgroup peak and oom reads)": 1,
    "destroy: total": 0, "destroy: whole": 1,
    "destroy: kill_all (cgroup kill + reap init)": 2,
    "cgroup: kill_all (freeze, SIGKILL, thaw, wait empty)": 3,
    "cgroup: list tasks (cgroup.procs of each hierarchy)": 3,
    "destroy: cgroup back to the pool or rmdir (Cgroup.release)": 2,
    "destroy: cgroup rmdir (Cgroup.destroy, when not pooled)": 3,
}
PHASE_ORDER = tuple(PHASE_DEPTH)


def case_phases(image: BenchImage | None, why: str | None, runs: int, log) -> dict:
    """Instrumented cycles, the variants taking turns; then per phase the median of each
    variant. An image phase no cycle reached stops the run (PhaseTimer)."""
    if image is None:
        return {"skipped": why}
    specs = image_specs(image)
    samples: dict[str, dict[str, list[int]]] = {v: {} for v in PHASE_VARIANTS}
    with PhaseTimer({**phase_table(), **IMAGE_SANDBOX_PHASES}) as timer:
        reach_every_phase()
        for v in PHASE_VARIANTS:  # warm: the page cache, the pool, the image's record
            instrumented_cycle(timer, specs[v], 0.0)
        for i in range(runs):
            k = i % len(PHASE_VARIANTS)
            for v in PHASE_VARIANTS[k:] + PHASE_VARIANTS[:k]:
                for label, ns in instrumented_cycle(timer, specs[v], 0.0).items():
                    samples[v].setdefault(label, []).append(ns)
    log(f"  phases: {runs} instrumented cycles of each of {', '.join(PHASE_VARIANTS)} done")
    labels = sorted({label for per in samples.values() for label in per})
    return {"runs": runs, "variants": list(PHASE_VARIANTS),
            "phases": {label: {v: asdict(Stats.of(samples[v][label])) for v in PHASE_VARIANTS
                               if samples[v].get(label)} for label in labels},
            "samples_ns": samples,
            "note": "medians of each phase over the cycles; phases nest (a step's time "
                    "includes the steps named under it); the timers add about 1 us each"}


# --------------------------------------------------------------------------- case 3

EPISODE_VARIANTS = (HOST, BY_REF, BY_NAME)


def _env_on(ref: str) -> bench_envs.AnswerFile:
    """bench_envs.AnswerFile with its image (and so its grader's) set to ref."""
    env = bench_envs.AnswerFile()
    env.image = ref
    return env


def case_episode(image: BenchImage | None, why: str | None, runs: int, warmup: int,
                 log) -> dict:
    envs = {HOST: bench_episode.ENV}
    if image is not None:
        envs.update({BY_REF: _env_on(image.ref), BY_NAME: _env_on(image.name)})
    skipped: dict[str, str] = {}
    for v, env in list(envs.items()):
        try:
            for i in range(warmup):  # the first grading copies the grader library
                bench_episode._episode(i, env=env)
        except (KarotteError, RuntimeError) as exc:
            skipped[v] = f"an episode on {env.image} fails here: {exc}"
            del envs[v]
    phases = bench_episode.PHASES
    samples = {(v, p): [] for v in envs for p in phases}
    names = list(envs)
    for i in range(runs):
        k = i % len(names)
        for v in names[k:] + names[:k]:
            measured, _, _ = bench_episode._episode(1000 + i, env=envs[v])
            for p in phases:
                samples[v, p].append(measured[p])
        if (i + 1) % max(1, runs // 4) == 0:
            log(f"  episode: {i + 1}/{runs} rounds")
    breakdown = _episode_breakdown(envs, max(3, runs // 2), log)
    series = []
    for v in EPISODE_VARIANTS:
        for p in phases:
            s = Series(f"{v}: {p}", bench_episode.PHASE_WHAT[p], samples.get((v, p), []))
            if v not in envs:
                s.skipped = skipped.get(v) or why
            series.append(s)
    end = {v: next(s for s in series if s.name == f"{v}: end to end").median_ms
           for v in EPISODE_VARIANTS}
    return {"runs": runs, "warmup": warmup, "variants": list(EPISODE_VARIANTS),
            "phases": list(phases), "series": [s.to_json() for s in series],
            "end_to_end_over_host": {v: _ratio(end[v], end[HOST]) for v in (BY_REF, BY_NAME)},
            "breakdown": breakdown}


def _episode_breakdown(envs: dict, runs: int, log) -> dict:
    """bench_episode.py's breakdown (its timers, its attribution) of `runs` episodes of
    each variant, taking turns: {label: {variant: stats}} in its table order."""
    clock_problem = bench_episode._same_clock()
    found: dict[str, dict[str, list[int]]] = {v: {} for v in envs}
    names = list(envs)
    with PhaseTimer(EPISODE_PHASES) as timer:
        for i in range(runs):
            k = i % len(names)
            for v in names[k:] + names[:k]:
                timer.take()
                measured, outcome, stamps = bench_episode._episode(5000 + i, env=envs[v])
                labels, _ = bench_episode._attribute(timer.take(), measured, outcome, stamps,
                                                     clock_problem)
                for label, ns in labels.items():
                    found[v].setdefault(label, []).append(ns)
    log(f"  episode: {runs} instrumented episodes of each variant done")
    order = [label for label, _ in bench_episode.BREAKDOWN]
    return {"runs": runs, "grader_stamps": clock_problem or "ok", "order": order,
            "depth": dict(bench_episode.BREAKDOWN),
            "phases": {label: {v: asdict(Stats.of(found[v][label])) for v in names
                               if found[v].get(label)} for label in order
                       if any(found[v].get(label) for v in names)}}


# --------------------------------------------------------------------------- report

def _fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def goals(cases: dict) -> list[Goal]:
    out = []
    lc = cases.get("lifecycle")
    if lc:
        med = {s["name"]: s["stats"]["median_ms"] for s in lc["series"] if s["status"] == "ok"}
        for v in (BY_REF, BY_NAME):
            text = f"create + exec /bin/true + destroy, {v}, within {GOAL_RATIO:g}x of the host"
            r = lc["over_host"][v]
            out.append(Goal(text, f"ratio < {GOAL_RATIO:g}",
                            f"{v} not measured" if r is None else
                            f"{med[v]:.2f} ms vs {med[HOST]:.2f} ms = {r:.2f}x",
                            None if r is None else r < GOAL_RATIO))
    ep = cases.get("episode")
    if ep:
        st = {s["name"]: s["stats"] for s in ep["series"] if s["status"] == "ok"}
        for v in (BY_REF, BY_NAME):
            s = st.get(f"{v}: end to end")
            r = ep["end_to_end_over_host"][v]
            out.append(Goal(f"minimal episode end to end, {v}",
                            f"median < {GOAL_EPISODE_MS:g} ms",
                            f"{v} not measured" if s is None else
                            f"{s['median_ms']:.1f} ms (p90 {s['p90_ms']:.1f}), "
                            f"{_fmt_ratio(r)} the host's",
                            None if s is None else s["median_ms"] < GOAL_EPISODE_MS))
    return out


HEADER = ["| series | median ms | p10 ms | p90 ms | n | ratio to the host |",
          "|---|---:|---:|---:|---:|---:|"]


def _render_lifecycle(lc: dict) -> list[str]:
    rows = []
    for s in lc["series"]:
        if s["status"] == "skipped":
            rows.append(f"| {s['name']} | skipped: {s['reason']} | | | | |")
            continue
        st = s["stats"]
        rows.append(f"| {s['name']} | {fmt_ms(st['median_ms'])} | {fmt_ms(st['p10_ms'])} | "
                    f"{fmt_ms(st['p90_ms'])} | {st['n']} | "
                    f"{_fmt_ratio(lc['over_host'].get(s['name'], 1.0))} |")
    return [f"## 1. create + exec /bin/true + destroy ({lc['runs']} runs each, round-robin)",
            "", *HEADER, *rows, "", *(f"- {s['name']}: {s['what']}" for s in lc["series"]),
            load_line(lc), ""]


def _render_phases(ph: dict) -> list[str]:
    if "skipped" in ph:
        return ["## 2. where the difference goes", "", f"skipped: {ph['skipped']}", ""]
    vs = ph["variants"]
    lines = [f"## 2. where the difference goes ({ph['runs']} instrumented cycles of each, "
             "taking turns; medians in ms; phases nest)", "",
             "| phase | " + " | ".join(vs) + f" | {BY_REF} - host | {BY_NAME} - host |",
             "|---|" + "---:|" * (len(vs) + 2)]
    def depth(label: str) -> int:
        return PHASE_DEPTH.get(label, 1 if ": total" not in label else 0)

    shown = [label for label in PHASE_ORDER if label in ph["phases"]]
    shown += sorted(set(ph["phases"]) - set(shown))  # a phase added to a table and not here
    for label in shown:
        per = ph["phases"][label]
        med = {v: per[v]["median_ms"] if v in per else None for v in vs}
        diff = [fmt_ms((med[v] or 0.0) - (med[HOST] or 0.0)) if med[v] is not None else "-"
                for v in (BY_REF, BY_NAME)]
        lines.append(f"| {'&nbsp;&nbsp;' * depth(label)}{label} | "
                     + " | ".join(fmt_ms(med[v]) for v in vs) + " | " + " | ".join(diff) + " |")
    return lines + ["", f"- {ph['note']}", load_line(ph), ""]


def _render_episode(ep: dict) -> list[str]:
    st = {s["name"]: s for s in ep["series"]}
    vs = ep["variants"]
    lines = [f"## 3. a minimal episode by phase ({ep['runs']} episodes of each, taking "
             "turns; medians in ms)", "", "| phase | " + " | ".join(vs) + " |",
             "|---|" + "---:|" * len(vs)]
    for p in ep["phases"]:
        cells = []
        for v in vs:
            s = st[f"{v}: {p}"]
            cells.append("skipped" if s["status"] != "ok" else fmt_ms(s["stats"]["median_ms"]))
        name = f"**{p}**" if p == "end to end" else p
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for v in vs:
        s = st[f"{v}: end to end"]
        if s["status"] == "ok":
            lines.append("")
            lines.append(f"- {v}: end to end p10 {fmt_ms(s['stats']['p10_ms'])}, p90 "
                         f"{fmt_ms(s['stats']['p90_ms'])} ms"
                         + ("" if v == HOST else
                            f", {_fmt_ratio(ep['end_to_end_over_host'][v])} the host's"))
        else:
            lines.append(f"\n- {v}: skipped: {s['reason']}")
    bd = ep["breakdown"]
    lines += ["", f"### where an episode's difference goes ({bd['runs']} instrumented episodes "
              "of each, taking turns; medians in ms; phases nest)", "",
              "| phase | " + " | ".join(vs) + f" | {BY_REF} - host | {BY_NAME} - host |",
              "|---|" + "---:|" * (len(vs) + 2)]
    for label in bd["order"]:
        per = bd["phases"].get(label)
        if per is None:
            continue
        med = {v: per[v]["median_ms"] if v in per else None for v in vs}
        diff = [fmt_ms(med[v] - med[HOST]) if None not in (med[v], med[HOST]) else "-"
                for v in (BY_REF, BY_NAME)]
        lines.append(f"| {'&nbsp;&nbsp;' * bd['depth'][label]}{label} | "
                     + " | ".join(fmt_ms(med[v]) for v in vs) + " | " + " | ".join(diff) + " |")
    lines += ["", "- on an image, \"task files\" also holds the exec that checks the image has "
              "the tools' programs (episode.IMAGE_TOOLS); the grader's stamps: "
              + bd["grader_stamps"]]
    return lines + ["", load_line(ep), ""]


def render(result: dict) -> str:
    m = result["machine"]
    img = result["image"]
    if img.get("tree"):
        how = "built or unpacked now" if img["built"] else "a cache hit"
        got = (f"- image: {img['ref']} (named {img['name']} for the run), "
               f"{img['size'] / 2**20:.1f} MiB of files; import_image took "
               f"{img['get_seconds']:.2f} s ({how})")
    else:
        got = f"- image: {img['ref']}: none here ({img['why'] or 'no case needed it'})"
    lines = [f"# Karotte image sandbox benchmark, {m['date']}", "", machine_line(m),
             f"- cgroups: {m['cgroup_backend']}", karotte_line(m), got,
             f"- command: `{result['command']}`", ""]
    renderers = {"lifecycle": _render_lifecycle, "phases": _render_phases,
                 "episode": _render_episode}
    return render_cases_and_goals(lines, result, CASES, renderers)


# --------------------------------------------------------------------------- main

def _options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="a few runs of every case (CI smoke)")
    ap.add_argument("--image", default=DEFAULT_IMAGE, metavar="REF",
                    help=f"the image source to measure (default {DEFAULT_IMAGE}): debian:, "
                         "oci:, oci-archive: or docker-archive:")
    ap.add_argument("--runs", type=int, help="runs of each series in case 1 (default 300, "
                    "quick 5); case 2 instruments a third as many cycles of each")
    ap.add_argument("--episodes", type=int, help="episodes of each variant in case 3 "
                    "(default 100, quick 3)")


def _plan(ap: argparse.ArgumentParser, args: argparse.Namespace, log,
          got: dict) -> tuple[dict, dict]:
    """The options and the cases; the image is got (into `got`) when a case first needs it."""
    try:
        ref = images.parse(args.image)
    except images.ImageRefError as exc:
        ap.error(str(exc))
    if ref.kind in ("host", "dir", "name"):
        ap.error(f"--image {args.image}: give an image source (debian:, oci:, oci-archive:, "
                 "docker-archive:); the run imports it, names it and measures it by both, "
                 "and as dir: of its tree")
    runs = args.runs or (5 if args.quick else 300)
    episodes = args.episodes or (3 if args.quick else 100)
    if runs < 1 or episodes < 1:
        ap.error("--runs and --episodes must be at least 1")
    warmup = 1 if args.quick else 5
    got["ref"] = str(ref)

    def image() -> tuple[BenchImage | None, str | None]:
        if "image" not in got:
            got["image"], got["why"] = get_image(str(ref), log)
        return got["image"], got["why"]

    runners = {
        "lifecycle": lambda: case_lifecycle(*image(), runs, warmup, log),
        "phases": lambda: case_phases(*image(), max(3, runs // 3), log),
        "episode": lambda: case_episode(*image(), episodes, warmup, log),
    }
    return {"image": str(ref), "runs": runs, "episodes": episodes}, runners


def _facts(got: dict) -> dict:
    image = got.get("image")
    return {"image": {"ref": got.get("ref"), "why": got.get("why"),
                      **(asdict(image) if image else {})}}


def main(argv: list[str] | None = None) -> int:
    got: dict = {}
    try:
        return bench_main(argv, doc=__doc__, script=__file__, cases=CASES,
                          add_options=_options,
                          plan=lambda ap, args, log: _plan(ap, args, log, got),
                          goals=goals, render=render, facts=lambda: _facts(got))
    finally:
        drop_name(got.get("image"))


if __name__ == "__main__":
    sys.exit(main())
