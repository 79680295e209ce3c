#!/usr/bin/env python3
"""How many bits one Karotte sandbox can pass to another through host-shared kernel state.

    scripts/bench_side_channels.py [--quick] [--bits N] [--runs N] [--channels a,b]
                                   [--image TREE [--reflink] [--stride N]] [--json FILE]

A sender sandbox and a receiver sandbox, both real Karotte sandboxes with the default
spec (the host's /usr bound read-only; the image channels: on an image), and each channel run --runs times with --bits
random bits. For each channel: bits/s, the bit error rate, and the capacity that leaves
(bits/s times 1 - H(error rate)), medians over the runs.

Channels through the page cache of the read-only /usr. The sender sandbox marks a 1 by
reading one byte of a page of a cold file (POSIX_FADV_RANDOM, so that no readahead
marks the neighbours), and is closed before the receiver sandbox is made: the marks
outlive the sandbox that set them, as they would outlive an untimed check run before
a timed one (LINK-CACHE-01).

  cache-timing   the receiver times a one-byte pread of each page: a cached page
                 answers in about a microsecond, a cold one waits for the disk.
  cache-pagemap  the receiver maps the file (MADV_RANDOM: no readaround), touches the
                 first page of each aligned 16-page window and reads /proc/self/pagemap:
                 the kernel's fault-around mapped the window's cached pages, so 15 bits
                 per window come out without timing anything, and without caching them.
  rwf-nowait     preadv2(RWF_NOWAIT) of each page, which would fail with EAGAIN where the
                 page is cold; denied by the policy (EOPNOTSUPP).
  cachestat      cachestat(2) of each page; denied by the policy (EPERM).
  mincore        mincore(2) of a mapping of the file: allowed, and for a file the caller
                 may not write the kernel says every page is resident.
  map-populate   mmap(MAP_POPULATE | MAP_NONBLOCK), which once mapped only the cached
                 pages, then /proc/self/pagemap: the kernel maps none.

Every bit of a cache channel uses a page that was cold when the run began, read ones
and zeros alike (the receiver's read caches it, or the sender's did): the number of cold
pages under /usr, which the benchmark counts first (cachestat from the host), bounds
what these channels carry until the host evicts the pages again. The benchmark never
drops caches (the host is shared): it finds pages that no one has read since boot.

Channels that need both sandboxes alive at once (LINK-SIBLING-01):

  futex          the receiver waits (futex_waitv) on two words of a page of a file under
                 /usr; the sender wakes the word of each bit. A futex on a file page is
                 keyed by the host's inode, the same in every sandbox.
  inotify        the receiver watches two files under /usr for IN_OPEN; the sender opens
                 the file of each bit, then a third file, so that no two events in a row
                 are the same (inotify merges those).
  inotify-dev    the same on /dev/full, /dev/zero and /dev/random: the host's device
                 nodes, bound into every sandbox's /dev, with or without a private userland.

Channels through the page cache of an image's tree (--image TREE, a tree with
/usr/bin/python3): the bench copies it (to an xfs of its own with --reflink) and adds its
own file, /karotte-bench/blob, whose pages it drops from the host's caches before each
run. The sender's sandbox is closed before the receiver's is made, as for the cache
channels above.

  image-timing, image-pagemap      both sandboxes on the image itself: every sandbox on
                                   an image reads the same lower inodes
  private-timing, private-pagemap  each sandbox on a private copy of its own
                                   (karotte/private_tree.py, ctx.run's private_userland):
                                   a copy into the tmpfs, or with --reflink a reflink,
                                   whose data blocks the copies share (--stride N spaces
                                   the bits N pages apart, past the readahead of a cache
                                   below the filesystem)

Needs what Karotte needs, and root for the census of cold pages (cachestat of files the
caller may not write is refused).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, REPO)

from karotte.private_tree import private_tree  # noqa: E402
from karotte.sandbox import Sandbox  # noqa: E402
from karotte.seccomp import SYSCALL_NUMBERS  # noqa: E402
from karotte.spec import SandboxSpec  # noqa: E402

PAGE = 4096
WINDOW = 16  # fault-around maps up to 64 KiB around a fault, aligned to it
CACHE_CHANNELS = ("cache-timing", "cache-pagemap", "rwf-nowait", "cachestat", "mincore",
                  "map-populate")
LIVE_CHANNELS = ("futex", "inotify", "inotify-dev")
CHANNELS = CACHE_CHANNELS + LIVE_CHANNELS  # those on the host's /usr and /dev: the default
IMAGE_CHANNELS = ("image-timing", "image-pagemap", "private-timing", "private-pagemap")
PYTHON = "/usr/bin/python3"  # the host's, bound read-only into every sandbox
ARCH = os.uname().machine

# --- Programs that run inside the sandboxes --------------------------------------------
#
# Each prints one JSON object. Syscall numbers come in through argv (from Karotte's table),
# so the programs hold no per-architecture numbers of their own.

SENDER_CACHE = r"""
import json, os, sys, time
path, pages = sys.argv[1], json.loads(sys.argv[2])
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # only the page asked for: no readahead
start = time.perf_counter()
for page in pages:
    os.pread(fd, 1, page * 4096)
print(json.dumps({"seconds": time.perf_counter() - start}))
"""

# argv: method, path, pages (JSON), syscall numbers (JSON). "results" holds one entry per
# page: nanoseconds for timing, else "1" (cached), "0" (cold) or the errno name. The
# methods are those of the module docstring (timing, pagemap, populate, nowait,
# cachestat, mincore).
RECEIVER_CACHE = r"""
import ctypes, errno, json, mmap, os, struct, sys, time
method, path, pages, nr = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long)
PAGE = 4096
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size

def failed():
    code = ctypes.get_errno()
    return "EOPNOTSUPP" if code == errno.EOPNOTSUPP else errno.errorcode[code]

def mapping(align):
    # The whole file at an address aligned to `align` bytes, so that file page p is
    # virtual page base + p and a fault-around window is 16 file pages.
    span = libc.mmap(None, size + align, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # PROT_NONE
    base = (span + align - 1) // align * align
    addr = libc.mmap(base, size, mmap.PROT_READ, mmap.MAP_SHARED | 0x10, fd, 0)  # MAP_FIXED
    if addr != base:
        raise OSError(ctypes.get_errno(), "mmap")
    return addr

class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

class Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

class Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted",
                                                       "recently_evicted")]

results = []
start = time.perf_counter()
if method == "timing":
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    for page in pages:
        t = time.perf_counter_ns()
        os.pread(fd, 1, page * PAGE)
        results.append(time.perf_counter_ns() - t)
elif method == "pagemap":
    addr = mapping(16 * PAGE)
    libc.syscall(nr["madvise"], ctypes.c_void_p(addr), ctypes.c_size_t(size), 1)  # MADV_RANDOM
    wanted = set(pages)
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:  # each read is fresh
        for window in sorted({page - page % 16 for page in pages}):
            ctypes.c_ubyte.from_address(addr + window * PAGE).value  # fault the window in
            pagemap.seek((addr // PAGE + window) * 8)
            entries = pagemap.read(16 * 8)
            for i in range(16):
                if window + i in wanted:
                    present = struct.unpack_from("<Q", entries, 8 * i)[0] >> 63
                    results.append((window + i, str(present)))
    order = {page: i for i, page in enumerate(pages)}
    results = [bit for _, bit in sorted(results, key=lambda pair: order[pair[0]])]
elif method == "populate":
    # MAP_POPULATE | MAP_NONBLOCK would map only the pages already cached; since Linux
    # 2.6.23 it maps none, which pagemap shows.
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED | 0x8000 | 0x10000, fd, 0)
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        for page in pages:
            pagemap.seek((addr // PAGE + page) * 8)
            results.append(str(struct.unpack("<Q", pagemap.read(8))[0] >> 63))
elif method == "nowait":
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # a hit must not read ahead the next page
    buf = ctypes.create_string_buffer(1)
    iov = Iovec(ctypes.cast(buf, ctypes.c_void_p), 1)
    for page in pages:
        ctypes.set_errno(0)
        rc = libc.syscall(nr["preadv2"], fd, ctypes.byref(iov), 1, ctypes.c_long(page * PAGE),
                          0, 8)  # RWF_NOWAIT
        results.append("1" if rc == 1 else "0" if ctypes.get_errno() == errno.EAGAIN else failed())
elif method == "cachestat":
    for page in pages:
        stat = Stat()
        ctypes.set_errno(0)
        rc = libc.syscall(nr["cachestat"], fd, ctypes.byref(Range(page * PAGE, PAGE)),
                          ctypes.byref(stat), 0)
        results.append(str(stat.cache) if rc == 0 else failed())
elif method == "mincore":
    addr = mapping(PAGE)
    vec = ctypes.create_string_buffer(-(-size // PAGE))
    ctypes.set_errno(0)
    if libc.syscall(nr["mincore"], ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
        results = [failed()] * len(pages)
    else:
        results = [str(vec.raw[page] & 1) for page in pages]
print(json.dumps({"seconds": time.perf_counter() - start, "results": results}))
"""

# argv: role, path, bits (JSON; the receiver gets their count), syscall numbers (JSON).
# A woken futex_waitv stays queued on its other futexes until it runs again, where a
# second wake would count it once more: so the receiver acknowledges each bit on a third
# futex, and the sender sends the next bit only then.
FUTEX = r"""
import ctypes, json, mmap, os, sys, time
role, path, bits, nr = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long)
fd = os.open(path, os.O_RDONLY)
page = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
zero, one, ack = page + 256, page + 512, page + 768  # futexes on a page of the host's inode
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # shared: no FUTEX_PRIVATE_FLAG

class Waitv(ctypes.Structure):
    _fields_ = [("val", ctypes.c_uint64), ("uaddr", ctypes.c_uint64), ("flags", ctypes.c_uint32),
                ("reserved", ctypes.c_uint32)]

class Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]

def value(addr):
    return ctypes.c_uint32.from_address(addr).value

def wake_waiter(addr, give_up):
    # Wakes the other side once it waits on addr; False if it never does.
    while libc.syscall(nr["futex"], ctypes.c_void_p(addr), FUTEX_WAKE, 1, 0, 0, 0) != 1:
        if time.monotonic() > give_up:
            return False
        os.sched_yield()
    return True

got, first, last = [], None, None
give_up = time.monotonic() + 30
if role == "receive":
    waitv = (Waitv * 2)(Waitv(value(zero), zero, 2, 0), Waitv(value(one), one, 2, 0))  # U32
    while len(got) < bits:
        deadline = time.clock_gettime(time.CLOCK_MONOTONIC) + 10
        until = Timespec(int(deadline), int(deadline % 1 * 1e9))
        index = libc.syscall(nr["futex_waitv"], waitv, 2, 0, ctypes.byref(until),
                             time.CLOCK_MONOTONIC)
        if index < 0 or not wake_waiter(ack, give_up):
            break
        last = time.perf_counter()
        first = first or last
        got.append(index)
else:
    timeout = Timespec(10, 0)
    for bit in bits:
        if not wake_waiter((zero, one)[bit], give_up):
            break
        libc.syscall(nr["futex"], ctypes.c_void_p(ack), FUTEX_WAIT, value(ack),
                     ctypes.byref(timeout), 0, 0)
        last = time.perf_counter()
        first = first or last
print(json.dumps({"bits": got, "seconds": (last - first) if first else 0.0}))
"""

# argv: role, files (JSON: the 0 file, the 1 file, the separator), bits (JSON; a count for
# the receiver).
INOTIFY = r"""
import ctypes, json, os, select, struct, sys, time
role, files, bits = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
got, first, last = [], None, None
if role == "receive":
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK)
    meaning = {libc.inotify_add_watch(fd, name.encode(), 0x20): value  # IN_OPEN
               for name, value in zip(files, (0, 1, None))}
    while len(got) < bits and select.select([fd], [], [], 10)[0]:
        data = os.read(fd, 65536)
        now = time.perf_counter()
        first = first or now
        for off in range(0, len(data), 16):
            wd = struct.unpack_from("i", data, off)[0]
            if meaning.get(wd) is not None:
                got.append(meaning[wd])
                last = now
else:
    first = time.perf_counter()
    for bit in bits:
        os.close(os.open(files[bit], os.O_RDONLY))
        os.close(os.open(files[2], os.O_RDONLY))
    last = time.perf_counter()
print(json.dumps({"bits": got, "seconds": (last - first) if first and last else 0.0}))
"""

# --- The host's side --------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted",
                                                       "recently_evicted")]


def cached_pages(path: str, first: int = 0, count: int = 0) -> int:
    """Pages of path (count from first; 0: to the end) in the page cache, by cachestat(2)
    from the host."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        stat = _CacheStat()
        rc = _libc.syscall(SYSCALL_NUMBERS["cachestat"][ARCH], fd,
                           ctypes.byref(_Range(first * PAGE, count * PAGE)), ctypes.byref(stat), 0)
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cachestat({path}): {os.strerror(err)}; the census needs root "
                               f"(or write access) and Linux 6.5 or later")
        return stat.cache
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Census:
    """The host's regular files under /usr, and how many of their pages are cold."""

    files: int
    pages: int
    cold_pages: int
    cold_files: tuple[tuple[str, int], ...]  # (path, pages), wholly cold, largest first


def census(top: str = "/usr", min_pages: int = 4096) -> Census:
    files = pages = cold = 0
    cold_files = []
    for root, _dirs, names in os.walk(top):
        for name in names:
            path = os.path.join(root, name)
            try:
                if os.path.islink(path) or not os.path.isfile(path):
                    continue
                n = -(-os.path.getsize(path) // PAGE)
                cached = cached_pages(path)
            except PermissionError:
                raise  # cachestat refused (not root): no census is possible, say so
            except OSError:
                continue  # vanished or unreadable; not part of what a sandbox can read
            files += 1
            pages += n
            cold += n - cached
            if n >= min_pages and cached == 0 and os.stat(path).st_mode & 0o004:
                cold_files.append((path, n))
    cold_files.sort(key=lambda item: -item[1])
    return Census(files, pages, cold, tuple(cold_files))


class ColdPages:
    """Hands out runs of pages that are cold right now, from the census's cold files."""

    def __init__(self, cold_files):
        self._files = list(cold_files)
        self._next = 0  # first page not yet handed out of self._files[0]

    def take(self, count: int, align: int = 1) -> tuple[str, int]:
        while self._files:
            path, pages = self._files[0]
            first = -(-self._next // align) * align
            if first + count <= pages and cached_pages(path, first, count) == 0:
                self._next = first + count
                return path, first
            if first + count <= pages:  # someone read part of it meanwhile: skip ahead
                self._next = first + count
                continue
            self._files.pop(0)
            self._next = 0
        raise RuntimeError("no cold pages left under /usr for another run; the host has not "
                           "evicted what earlier runs read. Run with fewer --bits or --runs")


def information(sent: list[int], received: list) -> float:
    """Bits of information per sent bit: the empirical mutual information between what
    was sent and what came out (a probe that fails, or says the same for every page,
    carries 0)."""
    n = len(sent)
    pairs: dict = {}
    for pair in zip(sent, received):
        pairs[pair] = pairs.get(pair, 0) + 1
    xs = {x: sum(c for (a, _), c in pairs.items() if a == x) for x, _ in pairs}
    ys = {y: sum(c for (_, b), c in pairs.items() if b == y) for _, y in pairs}
    return sum(c / n * math.log2(c * n / (xs[x] * ys[y])) for (x, y), c in pairs.items())


@dataclass(frozen=True)
class Run:
    channel: str
    bits: int
    decoded: int  # bits the probe answered at all (a denied probe answers none)
    errors: int  # wrong bits, an undecoded bit counted as a guess of 0
    information: float  # bits carried per bit sent (mutual information)
    seconds: float  # sender and receiver, as each timed its own loop
    failures: tuple[str, ...]  # the distinct errors a probe got, e.g. ("EOPNOTSUPP",)
    read_ns: tuple[float, float] | None = None  # cache-timing: median read of a 1, of a 0

    @property
    def error_rate(self) -> float:
        return self.errors / self.bits

    @property
    def bits_per_second(self) -> float:
        return self.bits / self.seconds if self.seconds > 0 else 0.0

    @property
    def capacity(self) -> float:
        """Information carried per second."""
        return self.bits_per_second * self.information


def _numbers() -> str:
    names = ("madvise", "mincore", "preadv2", "cachestat", "futex", "futex_waitv")
    return json.dumps({name: SYSCALL_NUMBERS[name][ARCH] for name in names})


def _exec(sb: Sandbox, program: str, *args: str) -> dict:
    r = sb.exec([PYTHON, "-I", "-c", program, *args], timeout=120)
    if r.exit_code != 0:
        raise RuntimeError(f"a channel program failed ({r.exit_code}, signal {r.signal}): "
                           f"{r.stderr.decode(errors='replace')[-2000:]}")
    return json.loads(r.stdout)


def threshold(latencies: list[int]) -> float:
    """The split between cached and cold reads: two-means on log latency."""
    logs = sorted(math.log(max(t, 1)) for t in latencies)
    cut = (logs[0] + logs[-1]) / 2
    for _ in range(50):
        low = [x for x in logs if x < cut] or [logs[0]]
        high = [x for x in logs if x >= cut] or [logs[-1]]
        cut = (statistics.fmean(low) + statistics.fmean(high)) / 2
    return math.exp(cut)


def send_marks(sender: Sandbox, path: str, pages: list[int]) -> float:
    """The sender reads one byte of each of `pages` of `path`; the seconds it took."""
    return _exec(sender, SENDER_CACHE, path, json.dumps(pages))["seconds"]


def receive_marks(receiver: Sandbox, method: str, path: str, pages: list[int]) -> dict:
    """The receiver probes `pages` of `path` by `method` (timing, pagemap, nowait,
    cachestat, mincore): {"seconds": ..., "results": one per page}."""
    return _exec(receiver, RECEIVER_CACHE, method, path, json.dumps(pages), _numbers())


def _layout(method: str, nbits: int, take, stride: int = 1) -> tuple[str, list[int]]:
    """The file and the pages that carry nbits: take(count, align) -> (path, first page).
    pagemap: 15 bits in each 16-page window, whose first page is the receiver's to fault;
    else one bit every `stride` pages."""
    if method == "pagemap":
        windows = -(-nbits // (WINDOW - 1))
        path, first = take(windows * WINDOW, WINDOW)
        pages = [first + w * WINDOW + 1 + i for w in range(windows) for i in range(WINDOW - 1)]
        return path, pages[:nbits]
    path, first = take(nbits * stride, 1)
    return path, [first + i * stride for i in range(nbits)]


def _run_of(channel: str, method: str, bits: list[int], sent: float, got: dict) -> Run:
    read_ns = None
    if method == "timing":
        cut = threshold(got["results"])
        decoded = [1 if t < cut else 0 for t in got["results"]]
        failures: tuple[str, ...] = ()
        read_ns = tuple(statistics.median(t for t, bit in zip(got["results"], bits) if bit == b)
                        for b in (1, 0))
    else:
        decoded = [int(r) if r.isdigit() else None for r in got["results"]]
        failures = tuple(sorted({r for r in got["results"] if not r.isdigit()}))
    errors = sum(1 for want, have in zip(bits, decoded) if (have or 0) != want)
    return Run(channel, len(bits), sum(d is not None for d in decoded), errors,
               information(bits, decoded), sent + got["seconds"], failures, read_ns)


def cache_run(channel: str, bits: list[int], cold: ColdPages) -> Run:
    method = {"cache-timing": "timing", "cache-pagemap": "pagemap", "rwf-nowait": "nowait",
              "map-populate": "populate"}.get(channel, channel)
    path, pages = _layout(method, len(bits), cold.take)
    with Sandbox() as sender:
        sent = send_marks(sender, path, [page for page, bit in zip(pages, bits) if bit])
    with Sandbox() as receiver:  # made after the sender's sandbox is gone
        got = receive_marks(receiver, method, path, pages)
    return _run_of(channel, method, bits, sent, got)


class BenchImage:
    """The image of the image channels: a copy of --image (a tree with python3) on disk,
    or with --reflink on an xfs of its own (a loop device) that holds the runtime
    directory too, so that private copies are reflinks; and in it the bench's own file,
    /karotte-bench/blob, whose pages the host drops before each run (the bench's file,
    not the host's: nothing else reads it)."""

    def __init__(self, source: str, reflink: bool, pages: int):
        self.base = tempfile.mkdtemp(prefix="karotte-bench-image-", dir="/var/tmp")
        os.chmod(self.base, 0o755)
        self.backing = None
        self._env = os.environ.get("KAROTTE_RUNTIME_DIR")
        top = self.base
        if reflink:
            self.backing = os.path.join(self.base, "xfs.img")
            with open(self.backing, "wb") as f:
                f.truncate(4 << 30)
            subprocess.run(["mkfs.xfs", "-q", self.backing], check=True)
            top = os.path.join(self.base, "mnt")
            os.mkdir(top)
            subprocess.run(["mount", "-o", "loop", self.backing, top], check=True)
            os.chmod(top, 0o755)
            runtime = os.path.join(top, "runtime")
            os.mkdir(runtime, 0o755)
            os.environ["KAROTTE_RUNTIME_DIR"] = runtime  # private copies go here: reflinks
        self.mount = top if reflink else None
        self.tree = os.path.join(top, "rootfs")
        subprocess.run(["cp", "-a", "--reflink=auto", source, self.tree], check=True)
        os.mkdir(os.path.join(self.tree, "karotte-bench"), 0o755)
        self.blob = os.path.join(self.tree, "karotte-bench", "blob")
        with open(self.blob, "wb") as f:
            for _ in range(-(-pages // 256)):
                f.write(os.urandom(256 * PAGE))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(self.blob, 0o644)
        self.pages = -(-pages // 256) * 256

    def cold(self) -> None:
        """Every page of the blob out of the host's caches: the xfs's, and the loop
        device's backing file's beneath it."""
        for path in (self.blob, self.backing):
            if path:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        if cached_pages(self.blob):
            raise RuntimeError(f"{self.blob} stayed cached after POSIX_FADV_DONTNEED")

    def take(self, count: int, align: int) -> tuple[str, int]:
        if count > self.pages:
            raise RuntimeError(f"the blob has {self.pages} pages, fewer than a run needs "
                               f"({count}); run with fewer --bits")
        return "/karotte-bench/blob", 0

    def close(self) -> None:
        if self._env is None:
            os.environ.pop("KAROTTE_RUNTIME_DIR", None)
        else:
            os.environ["KAROTTE_RUNTIME_DIR"] = self._env
        if self.mount:
            subprocess.run(["umount", self.mount], check=True)
        shutil.rmtree(self.base)


@contextlib.contextmanager
def userland(tree: str, private: bool):
    """A sandbox's image of the tree: the shared tree itself, or a private copy of it."""
    if not private:
        yield f"dir:{tree}"
        return
    with private_tree(f"dir:{tree}") as copy:
        yield copy.image


def image_run(channel: str, bits: list[int], image: BenchImage, stride: int = 1) -> Run:
    """A page-cache channel between two sandboxes on one image: the sender's run, closed
    before the receiver's is made (a check run, then a timed one), both on the image
    itself (image-*) or each on a private copy of its own (private-*). stride: the timing
    channels' bits that many pages apart (beyond the readahead of a cache below the
    filesystem, such as a loop device's backing file, which reflinked copies share)."""
    method = channel.split("-", 1)[1]
    private = channel.startswith("private-")
    path, pages = _layout(method, len(bits), image.take, stride)
    image.cold()
    with userland(image.tree, private) as root, Sandbox(SandboxSpec(image=root)) as sender:
        sent = send_marks(sender, path, [page for page, bit in zip(pages, bits) if bit])
    with userland(image.tree, private) as root, Sandbox(SandboxSpec(image=root)) as receiver:
        got = receive_marks(receiver, method, path, pages)
    return _run_of(channel, method, bits, sent, got)


def live_run(channel: str, bits: list[int]) -> Run:
    with Sandbox() as receiver, Sandbox() as sender:
        if channel == "futex":
            path = PYTHON
            program, args = FUTEX, (path,)
            tail = (_numbers(),)
        else:
            files = INOTIFY_DEV_FILES if channel == "inotify-dev" else INOTIFY_FILES
            program, args, tail = INOTIFY, (json.dumps(files),), ()
        heard: dict = {}
        listener = threading.Thread(target=lambda: heard.update(
            _exec(receiver, program, "receive", *args, json.dumps(len(bits)), *tail)))
        listener.start()
        time.sleep(1.0)  # the receiver is waiting before the first bit
        said = _exec(sender, program, "send", *args, json.dumps(bits), *tail)
        listener.join()
    got = heard["bits"] + [None] * (len(bits) - len(heard["bits"]))
    errors = sum(1 for want, have in zip(bits, got) if have != want)
    return Run(channel, len(bits), len(heard["bits"]), errors, information(bits, got),
               max(said["seconds"], heard["seconds"]), ())


INOTIFY_FILES = ["/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/Artistic",
                 "/usr/share/common-licenses/BSD"]
# The host's device nodes, which every sandbox has as binds in its /dev, on an image as on
# the host's userland: a private userland leaves these shared. Ones the host seldom opens.
INOTIFY_DEV_FILES = ["/dev/full", "/dev/zero", "/dev/random"]


def summarize(runs: list[Run]) -> dict:
    return {
        "runs": len(runs),
        "bits": runs[0].bits,
        "median_bits_per_second": statistics.median(r.bits_per_second for r in runs),
        "median_error_rate": statistics.median(r.error_rate for r in runs),
        "median_information_per_bit": statistics.median(r.information for r in runs),
        "median_capacity_bits_per_second": statistics.median(r.capacity for r in runs),
        "median_decoded_bits": statistics.median(r.decoded for r in runs),
        "failures": sorted({f for r in runs for f in r.failures}),
        **({"median_read_ns": {"cached": statistics.median(r.read_ns[0] for r in runs),
                               "cold": statistics.median(r.read_ns[1] for r in runs)}}
           if runs[0].read_ns else {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="256 bits, 2 runs (a smoke run)")
    ap.add_argument("--bits", type=int, help="bits per run (default 4096)")
    ap.add_argument("--runs", type=int, help="runs per channel (default 5)")
    ap.add_argument("--channels",
                    help=f"comma-separated subset of {','.join(CHANNELS + IMAGE_CHANNELS)} "
                         f"(default: {','.join(CHANNELS)}, and with --image the image "
                         f"channels)")
    ap.add_argument("--image", metavar="TREE",
                    help="a root filesystem tree with /usr/bin/python3 (one mmdebstrap made, "
                         "say) for the image channels; the bench runs on a copy of it")
    ap.add_argument("--reflink", action="store_true",
                    help="the image channels' image and $KAROTTE_RUNTIME_DIR on an xfs of "
                         "their own (a loop device; root, mkfs.xfs): private copies are "
                         "reflinks")
    ap.add_argument("--stride", type=int, default=1,
                    help="image timing channels: one bit every N pages (default 1)")
    ap.add_argument("--json", metavar="FILE", help="write every run and the summary")
    args = ap.parse_args(argv)
    default = CHANNELS + (IMAGE_CHANNELS if args.image else ())
    channels = [c for c in (args.channels or ",".join(default)).split(",") if c]
    unknown = sorted(set(channels) - set(CHANNELS + IMAGE_CHANNELS))
    if unknown:
        ap.error(f"unknown channels {', '.join(unknown)}; choose from "
                 f"{', '.join(CHANNELS + IMAGE_CHANNELS)}")
    if set(channels) & set(IMAGE_CHANNELS) and not args.image:
        ap.error("the image channels need --image TREE, a tree with /usr/bin/python3")
    nbits = args.bits or (256 if args.quick else 4096)
    nruns = args.runs or (2 if args.quick else 5)

    found = cold = None
    if set(channels) & set(CACHE_CHANNELS):
        print("census of /usr (cachestat from the host) ...", file=sys.stderr, flush=True)
        found = census()
        print(f"/usr: {found.files} files, {found.pages} pages, {found.cold_pages} cold "
              f"({found.cold_pages * PAGE / 2**30:.2f} GiB): each cache-channel bit takes one "
              f"cold page, so they carry at most {found.cold_pages} bits until the host evicts "
              f"them again; {len(found.cold_files)} wholly cold files of 16 MiB or more")
        cold = ColdPages(found.cold_files)
    image = None
    if set(channels) & set(IMAGE_CHANNELS):
        image = BenchImage(args.image, args.reflink,
                           max(nbits * args.stride, nbits * WINDOW // (WINDOW - 1) + WINDOW))
    rng = random.Random(20240607)
    results: dict[str, list[Run]] = {}
    try:
        for channel in channels:
            for n in range(nruns):
                bits = [rng.randint(0, 1) for _ in range(nbits)]
                if channel in CACHE_CHANNELS:
                    run = cache_run(channel, bits, cold)
                elif channel in IMAGE_CHANNELS:
                    run = image_run(channel, bits, image, args.stride)
                else:
                    run = live_run(channel, bits)
                results.setdefault(channel, []).append(run)
                print(f"  {channel} run {n + 1}: {run.bits_per_second:,.0f} bits/s, error rate "
                      f"{run.error_rate:.4f}, {run.information:.3f} bits of information per "
                      f"bit, {run.decoded} decoded"
                      + (f", probe failed: {', '.join(run.failures)}" if run.failures else ""),
                      file=sys.stderr, flush=True)
    finally:
        if image is not None:
            image.close()
    summary = {channel: summarize(runs) for channel, runs in results.items()}
    print(f"\n{'channel':15s} {'bits/s':>10s} {'error rate':>11s} {'info/bit':>9s} "
          f"{'capacity b/s':>13s} {'decoded':>8s}  probe failed")
    for channel, s in summary.items():
        print(f"{channel:15s} {s['median_bits_per_second']:10,.0f} {s['median_error_rate']:11.4f} "
              f"{s['median_information_per_bit']:9.3f} {s['median_capacity_bits_per_second']:13,.0f} "
              f"{s['median_decoded_bits']:8.0f}  {', '.join(s['failures']) or '-'}")
    for channel, s in summary.items():
        if "median_read_ns" in s:
            print(f"{channel}: a read of a cached page took {s['median_read_ns']['cached']:,.0f} "
                  f"ns, of a cold one {s['median_read_ns']['cold']:,.0f} ns (medians)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"census": found and {k: v for k, v in asdict(found).items()
                                            if k != "cold_files"},
                       "image": image and {"source": args.image, "reflink": args.reflink},
                       "summary": summary,
                       "runs": {c: [asdict(r) for r in rs] for c, rs in results.items()}},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
