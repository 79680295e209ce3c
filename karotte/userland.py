"""What of the host's userland a sandbox on the default "host" root must not see, and the
mounts that hide it.

A sandbox on the host userland sees the host's /usr (rootfs/default.json), and /usr holds
the trainer: its Python environment (a venv under /usr/local, or `pip install` as root into
/usr/local/lib/python3.X/dist-packages), Karotte itself, and the environment's package,
whose code makes the hidden data from the seed. All of that is hidden, computed once per
process on the host, as real paths (every symlink resolved) under a bound tree:

- the running interpreter's own installation when it is not the system's: sys.prefix,
  sys.exec_prefix and their base_ forms, unless one is /usr or /usr/local (a shared prefix:
  a venv or a pyenv version directory is hidden whole, the system's /usr never);
- every directory on sys.path (the trainer's cwd or script directory included), each
  site directory of the running interpreter (site.getsitepackages()), and every
  /usr/local/lib*/python3*/*-packages: where pip installs as root, never the distribution;
- the directory of the karotte package, wherever it was imported from;
- every Python environment two levels below /usr/local (a pyvenv.cfg or conda-meta in
  /usr/local/X or /usr/local/X/Y): other trainers' venvs on the same host;
- what the distributions of those site directories recorded installing elsewhere (their
  RECORD's "../" lines: console scripts in /usr/local/bin, data files in /usr/local/share);
  a directory all of whose entries are so recorded is hidden whole;
- the other names of a hidden file's hard links that lie in the visible tree (see below);
- per episode, the environment's own top-level package (package_binds, hide_package), for
  an environment imported from a directory that stays visible.

What stays visible, on purpose: the standard library of the running interpreter when it is
installed in a shared prefix (the sandbox's /usr/bin/python3, which graders run, needs its
own), and the distribution's own site directories, /usr/lib{,64}/python3[.N]/{dist,site}-
packages: Debian's and Fedora's package managers own them (pip writes to /usr/local), and
tasks want the python3-* packages there. A karotte or environment package found in one of
them is hidden on its own. Nothing is hidden that a program needs to run: /usr, /usr/local,
their direct program and library directories (/usr/bin, /usr/local/bin, /usr/local/lib...)
and the kept directories are never hidden whole; what of them is the trainer's is hidden
entry by entry. An environment that wants a hidden directory in its sandbox binds it
elsewhere (Bind(src, "/data")).

How: a read-only bind of an empty directory (or an empty file) of this process's own
(hostdirs, mode 0555/0444) over each hidden path, after the /usr bind it covers. A bind
costs no superblock, and being a read-only bind, not a tmpfs, even root inside cannot
write there. What the agent could use to reach the same files: a symlink anywhere in the
tree resolves inside the sandbox, through the same mount points (/lib/python3 is
/usr/lib/python3); /proc shows only the sandbox's processes, and /proc/1 (init, another
uid) refuses the agent its exe, maps, cwd and root; mountinfo names the hidden mount
points, not what is below them. A hard link is one inode under two names, and a bind hides
a name: so every regular file in what is hidden is stat'ed, and where one has more links
than the hidden tree holds (st_nlink), the visible tree on that file system is walked once
for the other names, which are hidden too. pip and venv make no hard links: a host pays
one stat per hidden file (8 ms per 1,000 files, once per process). uv's hardlink mode
links into its cache in /root/.cache, outside every bound tree: that costs the walk of
/usr (1 s for 118,000 files, once per process) and hides nothing more. docs/userland.md
has the decisions and their reasons.
"""
from __future__ import annotations

import csv
import glob
import json
import os
import re
import site
import sys
import sysconfig
from collections import Counter
from dataclasses import replace
from functools import lru_cache
from importlib import metadata, resources

from . import hostdirs
from .spec import Bind, SandboxSpec, path_within

SHARED_PREFIXES = ("/usr", "/usr/local")
# Where programs and their libraries live: hidden entry by entry, never whole.
PROGRAM_DIRS = tuple(f"{top}/{sub}" for top in SHARED_PREFIXES for sub in (
    "bin", "sbin", "lib", "lib32", "lib64", "libexec", "share", "include", "etc"))
DISTRIBUTION_SITE = re.compile(r"/usr/lib(64)?/python3(\.\d+)?/(dist|site)-packages")


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


@lru_cache(maxsize=1)
def roots() -> tuple[str, ...]:
    """The real host directories a host-userland sandbox binds (rootfs/default.json; a
    top-level symlink such as /lib -> usr/lib resolves into one of them)."""
    desc = json.loads(resources.files("karotte.rootfs").joinpath("default.json").read_text())
    return tuple(_real(p) for p in desc["userland"] if os.path.isdir(p)
                 and not os.path.islink(p))


def _visible(path: str) -> bool:
    return any(path_within(path, root) for root in roots())


@lru_cache(maxsize=1)
def kept() -> frozenset[str]:
    """What stays visible even when a candidate names it: the interpreter's standard
    library when it lives in a shared prefix, and the distribution's site directories."""
    paths = {p for p in map(_real, sys.path) if DISTRIBUTION_SITE.fullmatch(p)}
    if _real(sys.base_prefix) in SHARED_PREFIXES:
        # The base interpreter's, not a venv's (whose platstdlib names the venv).
        base = {"base": sys.base_prefix, "installed_base": sys.base_prefix,
                "platbase": sys.base_exec_prefix, "installed_platbase": sys.base_exec_prefix}
        stdlib = sysconfig.get_path("stdlib", vars=base)
        platstdlib = sysconfig.get_path("platstdlib", vars=base)
        v = sys.version_info
        paths.update(map(_real, (stdlib, platstdlib, os.path.join(platstdlib, "lib-dynload"),
                                 os.path.join(sys.base_prefix, "lib",
                                              f"python{v.major}{v.minor}.zip"))))
    return frozenset(paths)


def _protected(path: str) -> bool:
    """Whether hiding path would hide something sandboxes need (see the module's text)."""
    needed = roots() + SHARED_PREFIXES + PROGRAM_DIRS + tuple(kept())
    return any(path_within(p, path) for p in needed)


def _environments(top: str) -> set[str]:
    """Python environments (venvs, conda) in top/X and top/X/Y."""
    found = set()
    for pattern in ("*", "*/*"):
        for d in glob.glob(os.path.join(glob.escape(top), pattern)):
            if (os.path.isfile(os.path.join(d, "pyvenv.cfg"))
                    or os.path.isdir(os.path.join(d, "conda-meta"))):
                found.add(d)
    return found


def _recorded_outside(site_dir: str) -> set[str]:
    """Files that the distributions in site_dir recorded installing outside it."""
    found = set()
    for dist in metadata.distributions(path=[site_dir]):
        record = dist.read_text("RECORD") or ""
        for row in csv.reader(record.splitlines()):
            if row and row[0].startswith("../"):
                found.add(_real(os.path.join(site_dir, row[0])))
    return found


def _collapse(paths: set[str]) -> set[str]:
    """A directory all of whose entries are in paths stands for them, bottom up."""
    hidden = set(paths)
    parents = {os.path.dirname(p) for p in paths}
    while parents:
        above = set()
        for d in parents:
            if _protected(d):
                continue
            try:
                entries = [os.path.join(d, name) for name in os.listdir(d)]
            except OSError:
                continue
            if entries and all(e in hidden for e in entries):
                hidden.difference_update(entries)
                hidden.add(d)
                above.add(os.path.dirname(d))
        parents = above
    return hidden


def _outermost(paths: set[str]) -> tuple[str, ...]:
    """Visible, existing, unprotected paths, none inside another, sorted."""
    ok = sorted(p for p in paths if _visible(p) and os.path.lexists(p) and not _protected(p))
    out: list[str] = []
    for p in ok:  # sorted: a directory comes before what is inside it
        if not (out and path_within(p, out[-1])):
            out.append(p)
    return tuple(out)


def _walk_files(top: str, skip: tuple[str, ...] = ()):
    """(path, lstat) of every regular file below top (or top itself), never following a
    symlink, leaving out the directories in skip."""
    try:
        st = os.lstat(top)
    except OSError:
        return
    if not os.path.isdir(top) or os.path.islink(top):
        if os.path.isfile(top) and not os.path.islink(top):
            yield top, st
        return
    stack = [top]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if e.path not in skip:
                        stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    yield e.path, e.stat(follow_symlinks=False)
            except OSError:
                continue


def _other_links(hidden: tuple[str, ...]) -> set[str]:
    """The visible names of hard links to regular files in hidden."""
    links: dict[tuple[int, int], int] = {}
    seen: Counter[tuple[int, int]] = Counter()
    for top in hidden:
        for _, st in _walk_files(top):
            if st.st_nlink > 1:
                key = (st.st_dev, st.st_ino)
                links[key] = st.st_nlink
                seen[key] += 1
    missing = {key for key, n in links.items() if seen[key] < n}
    if not missing:
        return set()
    return {path for root in roots() for path, st in _walk_files(root, hidden)
            if (st.st_dev, st.st_ino) in missing}


def _hide(paths: set[str]) -> tuple[str, ...]:
    """paths, with the other names of their hard links, as outermost paths."""
    hidden = _outermost(paths)
    extra = _other_links(hidden)
    return _outermost(set(hidden) | extra) if extra else hidden


@lru_cache(maxsize=1)
def hidden_paths() -> tuple[str, ...]:
    """The host paths that no host-userland sandbox of this process sees, outermost only
    (see the module's text for what and why). Computed once, at the first sandbox."""
    candidates = {p for p in map(_real, (sys.prefix, sys.exec_prefix, sys.base_prefix,
                                         sys.base_exec_prefix)) if p not in SHARED_PREFIXES}
    candidates.update(_real(p or os.getcwd()) for p in sys.path)
    candidates.update(map(_real, site.getsitepackages()))
    candidates.update(map(_real, glob.glob("/usr/local/lib*/python3*/*-packages")))
    candidates.update(map(_real, _environments("/usr/local")))
    candidates.add(_real(os.path.dirname(__file__)))  # karotte itself
    sites = {p for p in candidates if p.endswith("-packages") and os.path.isdir(p)
             and _visible(p) and not DISTRIBUTION_SITE.fullmatch(p)}
    recorded = set()
    for site_dir in sites:
        recorded |= _recorded_outside(site_dir)
    return _hide(candidates | _collapse({p for p in recorded if _visible(p)
                                         and os.path.lexists(p)}))


@lru_cache(maxsize=1)
def _empty() -> tuple[str, str]:
    """An empty directory and an empty file of this process's, the hiding binds' sources."""
    top = hostdirs.new_dir("hide", 0o755)
    directory, file = os.path.join(top, "dir"), os.path.join(top, "file")
    os.mkdir(directory)
    os.chmod(directory, 0o555)
    with open(file, "x"):
        pass
    os.chmod(file, 0o444)
    return directory, file


def _source(path: str) -> str:
    directory, file = _empty()
    return directory if os.path.isdir(path) else file


def hiding_mounts() -> tuple[tuple[str, str], ...]:
    """(path, source) of each read-only bind that hides hidden_paths(): after the binds of
    the host's userland in the mount plan (karotte/mounts.py)."""
    return tuple((path, _source(path)) for path in hidden_paths())


@lru_cache(maxsize=None)
def package_binds(module: str) -> tuple[Bind, ...]:
    """Read-only binds that hide the top-level package of module ('pkg.mod' or an
    environment's 'pkg.mod:Name'; its directory, each directory of a namespace package,
    or a single module's file), where a host-userland sandbox would see it and
    hidden_paths() does not hide it already. The module is one this process imported."""
    top = sys.modules.get(module.partition(":")[0].split(".", 1)[0])
    if top is None:
        return ()
    where = list(getattr(top, "__path__", None) or ())
    if not where and getattr(top, "__file__", None):
        where = [top.__file__]
    already = hidden_paths()
    paths = {p for p in map(_real, where) if not any(path_within(p, h) for h in already)}
    return tuple(Bind(_source(p), p) for p in _hide(paths)
                 if not any(path_within(p, h) for h in already))


def hide_package(spec: SandboxSpec, module: str) -> SandboxSpec:
    """spec with package_binds(module) added: the sandbox of an episode or a grader of the
    environment in module. A bind of the spec's own that covers one of them (the
    environment asked to see it there) wins. A sandbox on an image has nothing of the
    host's userland to hide."""
    if spec.image != "host":
        return spec
    binds = tuple(b for b in package_binds(module)
                  if not any(path_within(b.dst, o.dst) or path_within(o.dst, b.dst)
                             for o in spec.binds))
    return replace(spec, binds=spec.binds + binds) if binds else spec
