#!/usr/bin/env python3
"""Karotte's image import against `tar -x` of the same layers, measured side by side in one run.

    scripts/bench_images.py [--quick] [--runs N] [--mib M] [--dir TMPFS]
                            [--cases a,b] [--json FILE]

The set-up makes a real image with the real tools: a tree of files copied from the host's
/usr/share, /usr/lib/python3* and /usr/lib (many small files, some large ones, symlinks),
committed by umoci in three layers (the third rewrites and deletes files of the first:
whiteouts), then `skopeo copy oci:L:t docker-archive:x.tar:repo/x:t`. Everything lives
in one directory on tmpfs (default /dev/shm), removed at the end, also on failure.

Cases (medians with p10/p90, and ratios):

  import    round-robin, with a rotating start, of:
            - Karotte's whole `Store(root).import_image("docker-archive:x.tar:repo/x:t")`
              into a fresh, empty store on tmpfs (each layer read once, ahead, and
              hashed by a thread while it is extracted, not kept; every file hashed as it
              is written; the tree's manifest, syncfs, records);
            - `tar -x` of the archive's layers (taken out of it in the set-up) into a fresh
              directory on tmpfs, in order: the floor;
            - a repeat import of the same archive into that store (a cache hit);
            - Karotte's import of umoci's own OCI layout, whose layers are gzip, against
              `gzip -dc LAYER | tar -x` of those blobs (skopeo writes docker-archive
              layers uncompressed: the set-up checks and reports what it found).
  phases    where the time of one import goes, from timers around Karotte's steps (the
            table is IMAGE_PHASES below: a name that is gone or never called stops the
            benchmark with its name).
  profile   cProfile of one import: the functions that take the most time, with their
            share of it (cProfile's own overhead inflates the Python-heavy ones).

Needs umoci, skopeo, GNU tar and gzip (scripts/setup installs the image tools).
"""
from __future__ import annotations

import argparse
import cProfile
import glob
import io
import json
import os
import pstats
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass

from benchlib import Goal, PhaseTimer, Series, Stats, fmt_ms, karotte_line, load_line, \
    machine_line, render_cases_and_goals
from benchlib import main as bench_main
from karotte.images import Store
from karotte.spec import MiB

CASES = ("import", "phases", "profile")

GOAL_VS_TAR = 1.5  # the import within 1.5x of tar -x of the same layers
GOAL_CACHE_HIT_MS = 50.0  # a repeat import under 50 ms

REPO_TAG = "repo/x:t"
NAME = "bench/x"
PREFIX = "karotte-bench-images-"  # the work directory: PREFIX<pid>-<random>
REPEATS = 5  # cache hits timed after each fresh import
TOOLS = ("umoci", "skopeo", "tar", "gzip")

# Karotte's names the phases case wraps: label -> (module, attribute), as benchlib's
# tables. A name that moves must move here too: PhaseTimer raises when one is gone or no
# call reached it.
IMAGE_PHASES: dict[str, tuple[str, str]] = {
    "import: whole (Store.import_image)": ("karotte.images.store", "Store.import_image"),
    "read manifest.json, the config (oci.read_image)": ("karotte.images.oci", "read_image"),
    "tree: build whole (Store._build)": ("karotte.images.store", "Store._build"),
    "tree: each layer: read once, hashed and extracted (Layers.from_source)":
        ("karotte.images.layers", "Layers.from_source"),
    "tree: each layer: extract (apply_layer)": ("karotte.images.layers", "apply_layer"),
    "tree: each layer: the blob thread's end and digest (BlobCopy.finish)":
        ("karotte.images.blobs", "BlobCopy.finish"),
    "tree: manifest.jsonl, a walk taking the files' hashes from extraction (manifest_file)":
        ("karotte.images.store", "manifest_file"),
    "tree: each layer: directories' modes and mtimes at its end (_Layer._finish)":
        ("karotte.images.treewalk", "TreeWalk._finish"),
    "tree: syncfs of the store's filesystem (syncfs)": ("karotte.images.store", "syncfs"),
    "records under sources/ and refs/ (Store._write_record)":
        ("karotte.images.store", "Store._write_record"),
}
PROFILE_TOP = 15


class BenchError(Exception):
    """The benchmark cannot run here; the message names what is missing."""


# --------------------------------------------------------------------------- the tree

def _small_sources() -> list[str]:
    return ["/usr/share", *sorted(glob.glob("/usr/lib/python3*"))]


def _large_sources() -> list[str]:
    return [*sorted(glob.glob("/usr/lib/*-linux-gnu")), "/usr/lib/gcc",
            *sorted(glob.glob("/usr/lib/llvm-*"))]


def _walk(roots: list[str], max_file: int):
    """(host path, lstat) of the regular files and symlinks under roots, in sorted order,
    never following a link; files over max_file bytes are passed over."""
    for root in roots:
        if not os.path.isdir(root) or os.path.islink(root):
            continue
        for top, dirs, files in os.walk(root):
            dirs.sort()
            names = sorted(files + [d for d in dirs if os.path.islink(os.path.join(top, d))])
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
            for name in names:
                path = os.path.join(top, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode)
                                                and st.st_size <= max_file):
                    yield path, st


@dataclass
class Layer:
    """What one layer of the image adds, rewrites and deletes (paths relative to /)."""

    name: str
    files: int = 0
    symlinks: int = 0
    bytes: int = 0
    large: int = 0  # files of 1 MiB or more
    rewritten: int = 0
    deleted: int = 0
    tar_bytes: int = 0  # the uncompressed layer tar, as it is in the archive
    gzip_bytes: int = 0  # umoci's gzip blob of it
    compression: str = ""  # of the archive's layer, by its first bytes


def _copy_in(rootfs: str, path: str, st: os.stat_result, layer: Layer,
             final: dict[str, int]) -> None:
    rel = path.lstrip("/")
    dest = os.path.join(rootfs, rel)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(path), dest)
        layer.symlinks += 1
        final[rel] = -1  # a symlink: no bytes of files
        return
    try:
        shutil.copyfile(path, dest, follow_symlinks=False)
    except OSError:
        return  # unreadable or gone: not part of the tree
    os.chmod(dest, stat.S_IMODE(st.st_mode) & 0o777)
    os.utime(dest, ns=(st.st_mtime_ns, st.st_mtime_ns))
    layer.files += 1
    layer.bytes += st.st_size
    layer.large += st.st_size >= MiB
    final[rel] = st.st_size


def _fill(rootfs: str, source, budget: int, layer: Layer, final: dict[str, int],
          taken: list[str] | None = None) -> None:
    for path, st in source:
        if layer.bytes >= budget:
            return
        if path.lstrip("/") in final:
            continue
        _copy_in(rootfs, path, st, layer, final)
        if taken is not None and stat.S_ISREG(st.st_mode):
            taken.append(path.lstrip("/"))


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchError(f"{what} failed (exit {done.returncode}): {' '.join(argv)}: "
                         f"{(done.stderr or done.stdout).strip()[-800:]}")


def _version(tool: str) -> str:
    out = subprocess.run([tool, "--version"], capture_output=True, text=True)
    return f"{tool} " + ((out.stdout or out.stderr).strip().splitlines() or ["?"])[0]


def _fs_type(path: str) -> str:
    """The filesystem type of the mount that holds path (/proc/self/mountinfo)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            point = left.split()[4].replace("\\040", " ")
            if (real == point or real.startswith(point.rstrip("/") + "/")) \
                    and len(point) >= len(best):
                best, kind = point, right.split()[0]
    return kind


def _sniff(head: bytes) -> str:
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    return "tar" if head[257:262] == b"ustar" else "unknown"


def remove_tree(path: str) -> None:
    """Remove path and all below it, whatever the modes an image gave its directories."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        for top, dirs, _ in os.walk(path):
            for d in dirs:
                full = os.path.join(top, d)
                if not os.path.islink(full):
                    os.chmod(full, 0o700)
        os.chmod(path, 0o700)
        shutil.rmtree(path)
    else:
        os.unlink(path)


class Workspace:
    """The image and everything the runs make, in one directory on tmpfs."""

    def __init__(self, base: str, size: int, log):
        self.size, self.log = size, log
        missing = [t for t in TOOLS if shutil.which(t) is None]
        if missing:
            raise BenchError(f"needs {', '.join(missing)} on PATH (scripts/setup installs "
                             f"umoci and skopeo)")
        if not os.path.isdir(base):
            raise BenchError(f"{base} is not a directory; give a tmpfs with --dir")
        self.fs_type = _fs_type(base)
        self.dir = os.path.join(base, f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(self.dir, 0o700)
        self.layout = os.path.join(self.dir, "L")
        self.archive = os.path.join(self.dir, "x.tar")
        self.layers: list[Layer] = []
        self.tars: list[str] = []  # the archive's layers, uncompressed, in order
        self.gzips: list[str] = []  # umoci's gzip blobs of the same layers, in order
        self.final: dict[str, int] = {}  # the image's files -> size; symlinks -> -1
        self.seconds = 0.0
        self._made = 0

    @property
    def docker_ref(self) -> str:
        return f"docker-archive:{self.archive}:{REPO_TAG}"

    @property
    def oci_ref(self) -> str:
        return f"oci:{self.layout}:t"

    @property
    def tree_bytes(self) -> int:
        return sum(size for size in self.final.values() if size > 0)

    def fresh(self, what: str) -> str:
        """A path under the work directory that nothing uses yet."""
        self._made += 1
        return os.path.join(self.dir, f"{what}-{self._made}")

    def close(self) -> None:
        remove_tree(self.dir)

    # -- the set-up

    def build(self) -> None:
        t0 = time.perf_counter()
        bundle = os.path.join(self.dir, "bundle")
        rootfs = os.path.join(bundle, "rootfs")
        layout = self.layout
        _run(["umoci", "init", "--layout", layout], "umoci init")
        _run(["umoci", "new", "--image", f"{layout}:t"], "umoci new")
        _run(["umoci", "config", "--image", f"{layout}:t", "--config.env", "A=1",
              "--config.workingdir", "/"], "umoci config")
        small = _walk(_small_sources(), 256 << 10)
        plan = [("small files (/usr/share, /usr/lib/python3*)", 0.45),
                ("libraries, some large (/usr/lib/*-linux-gnu, gcc, llvm)", 0.45),
                ("an update: rewrites and deletes files of layer 1, adds small ones", 0.10)]
        first: list[str] = []
        for number, (what, share) in enumerate(plan, 1):
            _run(["umoci", "unpack", "--rootless", "--image", f"{layout}:t", bundle],
                 "umoci unpack")
            layer = Layer(what)
            budget = int(self.size * share)
            if number == 1:
                _fill(rootfs, small, budget, layer, self.final, first)
            elif number == 2:
                _fill(rootfs, _walk(_large_sources(), 64 << 20), budget, layer, self.final)
            else:
                self._update(rootfs, first, layer)
                _fill(rootfs, small, budget, layer, self.final)
            self.log(f"  set-up: layer {number}: {layer.files} files, {layer.symlinks} "
                     f"symlinks, {layer.bytes / MiB:.0f} MiB; umoci repack")
            _run(["umoci", "repack", "--image", f"{layout}:t", bundle], "umoci repack")
            remove_tree(bundle)
            self.layers.append(layer)
        self.log("  set-up: skopeo copy to docker-archive")
        _run(["skopeo", "copy", "--quiet", f"oci:{layout}:t",
              f"docker-archive:{self.archive}:{REPO_TAG}"], "skopeo copy")
        self._take_layers()
        self.seconds = time.perf_counter() - t0

    def _update(self, rootfs: str, first: list[str], layer: Layer) -> None:
        """Layer 3 rewrites every 20th file of layer 1 and deletes every 50th (whiteouts)."""
        for i, rel in enumerate(first):
            path = os.path.join(rootfs, rel)
            if i % 20 == 10:
                with open(path, "ab") as f:
                    f.write(b"\nrewritten by layer 3\n")
                self.final[rel] = os.path.getsize(path)
                layer.rewritten += 1
                layer.bytes += self.final[rel]
            elif i % 50 == 25:
                os.unlink(path)
                del self.final[rel]
                layer.deleted += 1

    def _take_layers(self) -> None:
        """The archive's layers out of it as plain files (the floor's input), with what
        compression skopeo left them in; and umoci's gzip blobs of the same layers."""
        layers_dir = os.path.join(self.dir, "layers")
        os.mkdir(layers_dir)
        with tarfile.open(self.archive) as tar:
            entry = json.load(tar.extractfile("manifest.json"))[0]
            for number, where in enumerate(entry["Layers"], 1):
                member = tar.getmember(where)
                if member.issym():  # <id>/layer.tar -> ../<diff_id>.tar
                    member = tar.getmember(os.path.normpath(
                        os.path.join(os.path.dirname(where), member.linkname)))
                out = os.path.join(layers_dir, f"{number}.tar")
                with tar.extractfile(member) as src, open(out, "wb") as dst:
                    head = src.read(512)
                    dst.write(head)
                    shutil.copyfileobj(src, dst, 1 << 20)
                self.layers[number - 1].compression = _sniff(head)
                self.tars.append(out)
        for layer, path in zip(self.layers, self.tars):
            if layer.compression == "gzip":  # the floor extracts uncompressed tars
                _run(["sh", "-c", 'gzip -dc "$1" > "$1.tmp" && mv "$1.tmp" "$1"', "sh",
                      path], "gzip -dc of an archive layer")
            layer.tar_bytes = os.path.getsize(path)
        with open(os.path.join(self.layout, "index.json")) as f:
            manifest_digest = json.load(f)["manifests"][0]["digest"]
        with open(self._blob(manifest_digest)) as f:
            manifest = json.load(f)
        for layer, desc in zip(self.layers, manifest["layers"], strict=True):
            if not desc["mediaType"].endswith("+gzip"):
                raise BenchError(f"umoci wrote a {desc['mediaType']} layer, not gzip")
            self.gzips.append(self._blob(desc["digest"]))
            layer.gzip_bytes = os.path.getsize(self.gzips[-1])

    def _blob(self, digest: str) -> str:
        return os.path.join(self.layout, "blobs", "sha256", digest.split(":", 1)[1])

    def facts(self) -> dict:
        files = sum(1 for size in self.final.values() if size >= 0)
        return {"dir": self.dir, "fs_type": self.fs_type, "setup_seconds": self.seconds,
                "tree_files": files, "tree_symlinks": len(self.final) - files,
                "tree_bytes": self.tree_bytes,
                "archive_bytes": os.path.getsize(self.archive),
                "layers": [asdict(layer) for layer in self.layers],
                "tools": {t: _version(t) for t in TOOLS}}


# --------------------------------------------------------------------------- competitors

class Failed(Exception):
    """A competitor ran but did not succeed."""


def _ns() -> int:
    return time.perf_counter_ns()


def karotte_import(ws: Workspace, ref: str, root: str) -> int:
    """One import into the store at root (fresh: nothing there); checks the tree made."""
    t0 = _ns()
    image = Store(root).import_image(ref, NAME)
    t1 = _ns()
    if image.size != ws.tree_bytes:
        raise Failed(f"the tree of {ref} holds {image.size} bytes of files, the image "
                     f"{ws.tree_bytes}")
    return t1 - t0


def tar_layers(tars: list[str], dest: str) -> int:
    os.mkdir(dest, 0o755)
    t0 = _ns()
    for path in tars:
        done = subprocess.run(["tar", "-x", "-f", path, "-C", dest], capture_output=True)
        if done.returncode != 0:
            raise Failed(f"tar -x -f {path}: exit {done.returncode}: "
                         f"{done.stderr.decode(errors='replace').strip()[-400:]}")
    return _ns() - t0


def gzip_tar_layers(gzips: list[str], dest: str) -> int:
    os.mkdir(dest, 0o755)
    t0 = _ns()
    for path in gzips:
        gz = subprocess.Popen(["gzip", "-dc", path], stdout=subprocess.PIPE)
        tar = subprocess.Popen(["tar", "-x", "-f", "-", "-C", dest], stdin=gz.stdout,
                               stderr=subprocess.PIPE)
        gz.stdout.close()  # tar's alone now: gzip sees EPIPE if tar stops
        try:
            err = tar.communicate()[1]
        except BaseException:  # SIGTERM: nothing of ours may go on writing into dest
            for proc in (gz, tar):
                proc.kill()
                proc.wait()
            raise
        if gz.wait() != 0 or tar.returncode != 0:
            raise Failed(f"gzip -dc {path} | tar -x: exit {gz.returncode} | "
                         f"{tar.returncode}: {err.decode(errors='replace').strip()[-400:]}")
    return _ns() - t0


def case_import(ws: Workspace, runs: int, repeats: int, log) -> dict:
    karotte = Series("karotte import, docker-archive", "Store(fresh root).import_image("
                     f"'docker-archive:x.tar:{REPO_TAG}', name) on tmpfs: the whole import")
    floor = Series("tar -x of the same layers (floor)", "tar -x -f N.tar -C DIR for each "
                   "of the archive's layer tars in order, DIR a fresh directory on tmpfs "
                   "(GNU tar as this user: as root, owners and modes kept; no whiteouts "
                   "applied, no hashing)")
    hit = Series("karotte repeat import (cache hit)", "import_image of the same archive into "
                 f"the store it was just imported into, {repeats} times after each fresh "
                 "import")
    kgzip = Series("karotte import, OCI layout (gzip layers)", "Store(fresh root)."
                   "import_image('oci:L:t', name): umoci's layout, whose layers are gzip "
                   "(Python's gzip module)")
    gfloor = Series("gzip -dc | tar -x of the gzip layers (floor)", "gzip -dc BLOB | tar -x "
                    "-f - -C DIR for each of umoci's gzip layer blobs in order")

    def docker() -> None:
        root = ws.fresh("store")
        try:
            karotte.samples_ns.append(karotte_import(ws, ws.docker_ref, root))
            for _ in range(repeats):
                t0 = _ns()
                Store(root).import_image(ws.docker_ref, NAME)
                hit.samples_ns.append(_ns() - t0)
        finally:
            remove_tree(root)

    def oci_gzip() -> None:
        root = ws.fresh("store")
        try:
            kgzip.samples_ns.append(karotte_import(ws, ws.oci_ref, root))
        finally:
            remove_tree(root)

    def tar_floor(layers: list[str], series: Series, how) -> None:
        dest = ws.fresh("tar")
        try:
            series.samples_ns.append(how(layers, dest))
        finally:
            remove_tree(dest)

    steps = [docker, lambda: tar_floor(ws.tars, floor, tar_layers), oci_gzip,
             lambda: tar_floor(ws.gzips, gfloor, gzip_tar_layers)]
    for step in steps:  # untimed warm-up: page cache, imports, first-use costs
        step()
    for series in (karotte, hit, floor, kgzip, gfloor):
        series.samples_ns.clear()
    for i in range(runs):
        k = i % len(steps)
        for step in steps[k:] + steps[:k]:
            step()
        log(f"  import: {i + 1}/{runs} rounds")
    mib = ws.tree_bytes / MiB
    tar_mib = sum(layer.tar_bytes for layer in ws.layers) / MiB
    return {"runs": runs, "repeats": repeats,
            "series": [s.to_json() for s in (karotte, floor, hit, kgzip, gfloor)],
            "karotte_over_tar": _ratio(karotte.median_ms, floor.median_ms),
            "karotte_gzip_over_gzip_tar": _ratio(kgzip.median_ms, gfloor.median_ms),
            "tree_mib": mib, "layers_mib": tar_mib}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


# --------------------------------------------------------------------------- phases

def case_phases(ws: Workspace, runs: int, log) -> dict:
    totals: dict[str, list[int]] = {}
    with PhaseTimer(IMAGE_PHASES) as timer:
        for _ in range(runs):
            root = ws.fresh("store")
            try:
                Store(root).import_image(ws.docker_ref, NAME)
            finally:
                remove_tree(root)
            per: dict[str, int] = {}
            for label, s, e in timer.take():
                per[label] = per.get(label, 0) + (e - s)
            for label, ns in per.items():
                totals.setdefault(label, []).append(ns)
    log(f"  phases: {runs} instrumented imports done")
    return {"runs": runs,
            "phases": {label: asdict(Stats.of(ns)) for label, ns in totals.items()},
            "samples_ns": totals,
            "note": "medians over the runs of each step's time summed over its calls in one "
                    "import (per layer steps: all layers); steps nest"}


# --------------------------------------------------------------------------- profile

def _where(func: tuple[str, int, str]) -> str:
    path, line, name = func
    if path == "~":
        return name  # a builtin
    for marker in ("/karotte/", "/lib/python3"):
        if marker in path:
            path = path[path.index(marker) + 1:]
            break
    return f"{name} ({path}:{line})"


def case_profile(ws: Workspace, log) -> dict:
    root = ws.fresh("store")
    profiler = cProfile.Profile()
    try:
        t0 = _ns()
        profiler.enable()
        Store(root).import_image(ws.docker_ref, NAME)
        profiler.disable()
        wall = _ns() - t0
    finally:
        remove_tree(root)
    stats = pstats.Stats(profiler, stream=io.StringIO())
    total = stats.total_tt
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # by own time
    top = [{"function": _where(func), "calls": nc, "own_seconds": tt,
            "own_share": tt / total if total else None, "cumulative_seconds": ct}
           for func, (cc, nc, tt, ct, callers) in rows[:PROFILE_TOP]]
    log("  profile: one import under cProfile done")
    return {"wall_ms_profiled": wall / 1e6, "profiled_seconds": total, "top": top,
            "groups": _groups(stats.stats, total)}


# What the own time of a profile's functions is, by what they do: the first group whose
# key is in "path:function" takes it.
_GROUPS = (
    ("extraction's C run (csrc/extract.c): plain entries' syscalls and data",
     ("karotte_extract_run",)),
    ("the manifest's C walk (csrc/tree.c): fstatat, directories", ("karotte_tree",)),
    ("sha256 (blob copy, diff_id, files)", ("_hashlib",)),
    ("the layer tar reader (tarstream.py): headers, data views", ("tarstream.py",)),
    ("tarfile: the archive's own table and member reads", ("tarfile.py",)),
    ("json", ("json/",)),
    ("file data: os.read, os.write, buffered file reads and writes",
     ("posix.read>", "posix.write>", "posix.preadv>", "_io.Buffered", "_io.FileIO")),
    ("other syscalls: open, stat, chmod, chown, utime, mkdir, listdir, sync, ...",
     ("posix.",)),
    ("karotte's own Python (extract.py, whiteout.py, tree.py, store.py, layers.py, ...)",
     ("karotte/",)),
)


def _group(func: tuple[str, int, str]) -> str | None:
    text = f"{func[0]}:{func[2]}"
    return next((label for label, keys in _GROUPS if any(k in text for k in keys)), None)


def _groups(raw: dict, total: float) -> list[dict]:
    """Own time by group. A builtin of no group of its own (len, sum, struct.unpack_from,
    bytes.find, ...) counts for the groups of its callers, each with its share."""
    sums = {label: 0.0 for label, _ in _GROUPS}
    other = 0.0
    for func, (_, _, tt, _, callers) in raw.items():
        label = _group(func)
        if label is not None:
            sums[label] += tt
            continue
        if func[0] != "~" or not callers:
            other += tt
            continue
        for caller, edge in callers.items():
            by = _group(caller)
            if by is None:
                other += edge[2]
            else:
                sums[by] += edge[2]
    out = [{"group": label, "own_seconds": s, "share": s / total if total else None}
           for label, s in sums.items()]
    out.append({"group": "everything else", "own_seconds": other,
                "share": other / total if total else None})
    return out


# --------------------------------------------------------------------------- report

HEADER = ["| series | median ms | p10 ms | p90 ms | n | MiB/s | ratio |",
          "|---|---:|---:|---:|---:|---:|---:|"]


def _row(s: dict, mib: float | None, baseline: float | None) -> str:
    if s["status"] == "skipped":
        return f"| {s['name']} | skipped: {s['reason']} | | | | | |"
    st = s["stats"]
    rate = f"{mib / (st['median_ms'] / 1000):.0f}" if mib else ""
    ratio = _ratio(st["median_ms"], baseline)
    return (f"| {s['name']} | {fmt_ms(st['median_ms'])} | {fmt_ms(st['p10_ms'])} | "
            f"{fmt_ms(st['p90_ms'])} | {st['n']} | {rate} | "
            f"{'' if ratio is None else f'{ratio:.2f}x'} |")


def _median(case: dict, name: str) -> float | None:
    s = next((s for s in case["series"] if s["name"] == name), None)
    return s["stats"]["median_ms"] if s and s["status"] == "ok" else None


def _render_import(case: dict) -> list[str]:
    by = {s["name"]: s for s in case["series"]}
    names = [s["name"] for s in case["series"]]
    floor, gfloor = _median(case, names[1]), _median(case, names[4])
    mib = case["tree_mib"]
    return [f"## 1. import of the image against tar -x of its layers ({case['runs']} runs "
            f"each, round-robin; ratio = median / its floor's)", "", *HEADER,
            _row(by[names[0]], mib, floor), _row(by[names[1]], mib, floor),
            _row(by[names[2]], None, None), _row(by[names[3]], mib, gfloor),
            _row(by[names[4]], mib, gfloor), "",
            *(f"- {s['name']}: {s['what']}" for s in case["series"]),
            f"- MiB/s: the tree's {mib:.0f} MiB of files over the median", load_line(case),
            ""]


def _render_phases(case: dict) -> list[str]:
    wall = case["phases"]["import: whole (Store.import_image)"]["median_ms"]
    lines = [f"## 2. where one import goes ({case['runs']} instrumented imports of the "
             "docker-archive into a fresh store; steps nest)", "",
             "| step | median ms | p10 ms | p90 ms | share of the import |",
             "|---|---:|---:|---:|---:|"]
    for label, st in sorted(case["phases"].items(), key=lambda kv: -kv[1]["median_ms"]):
        lines.append(f"| {label} | {fmt_ms(st['median_ms'])} | {fmt_ms(st['p10_ms'])} | "
                     f"{fmt_ms(st['p90_ms'])} | {100 * st['median_ms'] / wall:.0f}% |")
    return lines + ["", load_line(case), ""]


def _render_profile(case: dict) -> list[str]:
    lines = [f"## 3. cProfile of one import ({case['wall_ms_profiled']:.0f} ms under the "
             f"profiler; {case['profiled_seconds']:.2f} s of profiled time)", "",
             "| by what it does | own s | share |", "|---|---:|---:|"]
    for g in sorted(case["groups"], key=lambda g: -g["own_seconds"]):
        lines.append(f"| {g['group']} | {g['own_seconds']:.2f} | "
                     f"{100 * (g['share'] or 0):.0f}% |")
    lines += ["", f"| top {PROFILE_TOP} functions by own time | calls | own s | share | "
              "cumulative s |", "|---|---:|---:|---:|---:|"]
    for t in case["top"]:
        lines.append(f"| {t['function']} | {t['calls']} | {t['own_seconds']:.3f} | "
                     f"{100 * (t['own_share'] or 0):.1f}% | {t['cumulative_seconds']:.3f} |")
    return lines + ["", load_line(case), ""]


def goals(cases: dict) -> list[Goal]:
    out = []
    imp = cases.get("import")
    if imp:
        names = [s["name"] for s in imp["series"]]
        k, floor, hit = (_median(imp, n) for n in names[:3])
        r = imp["karotte_over_tar"]
        out.append(Goal("import of the docker-archive within 1.5x of tar -x of its layers",
                        f"karotte/tar < {GOAL_VS_TAR:g}",
                        "not measured" if r is None else
                        f"{k:.0f} ms vs {floor:.0f} ms = {r:.2f}x",
                        None if r is None else r < GOAL_VS_TAR))
        out.append(Goal("repeat import (cache hit)", f"median < {GOAL_CACHE_HIT_MS:g} ms",
                        "not measured" if hit is None else f"{hit:.1f} ms",
                        None if hit is None else hit < GOAL_CACHE_HIT_MS))
    return out


def render(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Karotte image import benchmark, {m['date']}", "", machine_line(m),
             karotte_line(m), f"- command: `{result['command']}`"]
    img = result["image"]
    if img is not None:
        lines += _image_lines(img)
    renderers = {"import": _render_import, "phases": _render_phases,
                 "profile": _render_profile}
    return render_cases_and_goals(lines, result, CASES, renderers)


def _image_lines(img: dict) -> list[str]:
    layers = img["layers"]
    lines = [f"- tools: {'; '.join(img['tools'].values())}",
             f"- image: {img['tree_files']} files and {img['tree_symlinks']} symlinks, "
             f"{img['tree_bytes'] / MiB:.0f} MiB of files, in {len(layers)} layers made by "
             f"umoci; docker-archive by skopeo, {img['archive_bytes'] / MiB:.0f} MiB; made "
             f"in {img['setup_seconds']:.0f} s on {img['fs_type']} ({img['base']})",
             f"- layers in the docker-archive: "
             f"{', '.join(layer['compression'] for layer in layers)} (skopeo writes "
             f"docker-archive layers uncompressed); in umoci's OCI layout: gzip", ""]
    lines += ["| layer | files | of them >= 1 MiB | symlinks | rewritten | deleted | "
              "tar MiB | gzip MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for number, layer in enumerate(layers, 1):
        lines.append(f"| {number}: {layer['name']} | {layer['files']} | {layer['large']} | "
                     f"{layer['symlinks']} | {layer['rewritten']} | {layer['deleted']} | "
                     f"{layer['tar_bytes'] / MiB:.1f} | {layer['gzip_bytes'] / MiB:.1f} |")
    return lines + [""]


# --------------------------------------------------------------------------- main

def _options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="a 30 MiB image, 3 rounds, 1 instrumented import (CI smoke)")
    ap.add_argument("--runs", type=int, help="rounds of the import case (default 10, "
                    "quick 3); the phases case runs a third as many imports")
    ap.add_argument("--mib", type=int, help="MiB of files in the image (default 300, "
                    "quick 30)")
    ap.add_argument("--dir", default="/dev/shm",
                    help="the tmpfs the image, the stores and the tar trees go to "
                         "(default /dev/shm)")


class _Bench:
    """The workspace, made when the first case runs and removed when the benchmark ends."""

    def __init__(self):
        self.ws: Workspace | None = None
        self.args: argparse.Namespace | None = None

    def workspace(self, log) -> Workspace:
        if self.ws is None:
            assert self.args is not None
            self.ws = Workspace(self.args.dir, self.args.mib * MiB, log)
            log(f"  set-up: a {self.args.mib} MiB image in {self.ws.dir}")
            self.ws.build()
        return self.ws

    def plan(self, ap: argparse.ArgumentParser, args: argparse.Namespace, log):
        runs = args.runs or (3 if args.quick else 10)
        args.mib = args.mib or (30 if args.quick else 300)
        if runs < 1 or args.mib < 1:
            ap.error("--runs and --mib must be at least 1")
        self.args = args
        runners = {
            "import": lambda: case_import(self.workspace(log), runs,
                                          2 if args.quick else REPEATS, log),
            "phases": lambda: case_phases(self.workspace(log), max(1, runs // 3), log),
            "profile": lambda: case_profile(self.workspace(log), log),
        }
        return {"runs": runs, "mib": args.mib, "dir": args.dir}, runners

    def render(self, result: dict) -> str:
        result["image"] = None if self.ws is None else \
            {**self.ws.facts(), "base": self.args.dir}
        return render(result)

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally that removes the workspace


def main(argv: list[str] | None = None) -> int:
    bench = _Bench()
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return bench_main(argv, doc=__doc__, script=__file__, cases=CASES,
                          add_options=_options, plan=bench.plan, goals=goals,
                          render=bench.render)
    except (BenchError, Failed) as exc:
        print(f"bench_images: {exc}", file=sys.stderr)
        return 1
    finally:
        bench.close()
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
