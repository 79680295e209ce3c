"""The content-addressed image store: verified blobs, read-only unpacked trees keyed by
chain id, names, uses that keep gc away, and gc (karotte/images/collect.py).

    ROOT/blobs/sha256/<hex>        manifests, configs, layers Karotte made (dir:, debian:)
                                   or zstd reads; verified by sha256 as copied in
    ROOT/trees/<chain-hex>@<ids>/  rootfs/ (the tree), manifest.jsonl, image.json
    ROOT/locks/<chain-hex>@<ids>   the tree's lock: shared while used, exclusive for gc
    ROOT/refs/<name>               a name given at import -> the image record (JSON)
    ROOT/sources/<sha256>          the last import of a source ref -> the image record
    ROOT/tmp/                      imports under way (a tree is built here, then renamed)
    ROOT/store.lock                shared by imports, exclusive while gc removes blobs

<ids> is the host id that the image's uid 0 is stored as: KAROTTE_UID_BASE for a root
caller (ids below 65536 are shifted by it, as the sandbox maps them), `uid<N>` for an
unprivileged caller N (who owns every file; the sandbox maps the caller to root).
docs/images.md has the design and the threat model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from . import oci, sources
from .blobs import fsync_dir, pooled, remove, syncfs, write_file
from .collect import Collecting, GcResult  # noqa: F401 (GcResult: public here too)
from .extract import LayerBudget, image_ids
from .layers import Building, Layers
from .oci import ImageError, chain_ids
from .tree import entry_dict, manifest, manifest_file
from ..imageref import ImageRef, parse, parse_name

ENV_IMAGE_DIR = "KAROTTE_IMAGE_DIR"
ROOT_IMAGE_DIR = "/var/lib/karotte/images"
NOBODY = 65534
_CHUNK = 1 << 20
# Parsed image configs by blob digest: content-addressed, so one parse serves the process.
_CONFIGS: dict[str, dict] = {}


class ImageNotFound(ImageError):
    """A name or source that the store holds no image for."""


@dataclass(frozen=True)
class ImageConfig:
    """What the image config says about how to run it (the OCI config's `config`)."""

    env: tuple[str, ...] = ()  # "KEY=VALUE", in order
    working_dir: str | None = None
    user: str | None = None
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()


@dataclass(frozen=True)
class Image:
    """An image in the store: its name (None: imported without one), where it came from,
    its chain id, and the read-only tree a sandbox mounts as the lower of its overlay."""

    name: str | None
    source: str  # the image reference it was imported from, as text
    chain_id: str  # "sha256:<hex>"
    tree: str  # the tree's root directory (ROOT/trees/<key>/rootfs)
    config: ImageConfig
    config_digest: str
    layers: tuple[str, ...]  # the layers' blob digests, in order
    diff_ids: tuple[str, ...]
    size: int  # bytes of the regular files in the tree
    created: float  # when this name (or source) was recorded, seconds since the epoch


@dataclass(frozen=True)
class ImportProgress:
    """Where an import is, as import_image's progress callback hears it: "build" (mmdebstrap
    builds a debian: image: no counts), "layer" (layer `layer` of `layers`: `done` of
    `total` bytes of its blob read, copied and extracted; total None where unknown),
    "manifest" (the tree's manifest is written)."""

    step: str
    layer: int = 0
    layers: int = 0
    done: int = 0
    total: int | None = None


Progress = Callable[[ImportProgress], None]


@dataclass(frozen=True)
class Verification:
    """What `Store.verify` found: the tree against its manifest. ok when problems is empty."""

    chain_id: str
    tree: str
    entries: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def default_root() -> str:
    """$KAROTTE_IMAGE_DIR; else /var/lib/karotte/images for root; else the XDG cache."""
    if os.environ.get(ENV_IMAGE_DIR):
        return os.environ[ENV_IMAGE_DIR]
    if os.geteuid() == 0:
        return ROOT_IMAGE_DIR
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "karotte", "images")


class Store(Collecting):
    """The image store at root (default_root()); made on first use."""

    def __init__(self, root: str | None = None, *, budget: LayerBudget | None = None):
        self.root = os.path.abspath(root or default_root())
        self.budget = budget or LayerBudget()
        if os.geteuid() == 0:
            # The image's own ids, as the image says (above 65535: nobody): a sandbox sees
            # them through an idmapped mount onto its user namespace (karotte/imageroot.py),
            # and no host user reaches the tree (the store is 0700).
            self.ids_key = "root"
            self._ids: Callable[[int, int], tuple[int, int]] | None = image_ids
        else:
            self.ids_key, self._ids = f"uid{os.getuid()}", None
        self.layers = Layers(self.root, self.budget, self._ids)

    @property
    def extractions(self) -> int:
        """Layers this object has unpacked (a cache hit unpacks none)."""
        return self.layers.extractions

    # -- layout ---------------------------------------------------------------------

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _tree_key(self, chain_id: str) -> str:
        return f"{oci.digest_hex(chain_id, 'chain id')}@{self.ids_key}"

    def _ensure(self) -> None:
        # Nothing is reachable by other host users: as root, the trees hold files of the
        # image's own ids, which may be host accounts' (the host hands each sandbox an
        # idmapped mount of its tree); unprivileged, init runs as the caller itself.
        for sub, mode in (("", 0o700), ("trees", 0o700), ("blobs/sha256", 0o700),
                          ("locks", 0o700), ("refs", 0o700), ("sources", 0o700),
                          ("tmp", 0o700)):
            path = self._path(sub) if sub else self.root
            try:
                os.makedirs(path, mode=mode, exist_ok=True)
            except OSError as exc:
                raise ImageError(f"cannot make the image store at {self.root}: {exc.strerror}; "
                                 f"set {ENV_IMAGE_DIR} to a directory you can write") from None

    def _flock(self, path: str, kind: int) -> int | None:
        """A fd of the lock file path under flock(kind); None where LOCK_NB found it taken."""
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, kind)
            except BlockingIOError:
                os.close(fd)
                return None
            try:
                # gc unlinks a removed tree's lock: a lock on that old inode guards nothing.
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    @contextlib.contextmanager
    def _lock(self, path: str, kind: int) -> Iterator[bool]:
        """flock(kind) on the lock file path for the block; yields whether it was taken."""
        fd = self._flock(path, kind)
        try:
            yield fd is not None
        finally:
            if fd is not None:
                os.close(fd)

    def _hold(self, key: str, what: str) -> int:
        """A shared lock on tree key, which is there: gc leaves it alone while it is held."""
        fd = self._flock(self._path("locks", key), fcntl.LOCK_SH)
        assert fd is not None
        if not os.path.isdir(self._path("trees", key)):
            os.close(fd)
            raise ImageNotFound(f"the tree of {what} is gone from {self.root} (gc took it, "
                                f"or it was removed by hand); import it again")
        return fd

    # -- import ---------------------------------------------------------------------

    def import_image(self, ref: ImageRef | str, name: str | None = None, *,
                     progress: Progress | None = None) -> Image:
        """Import ref into the store (a cache hit if its tree is here) and record it, under
        name if given. Atomic: a failed import leaves nothing a name refers to. progress,
        if given, is called as the import goes (ImportProgress), in this thread."""
        ref = parse(ref) if isinstance(ref, str) else ref
        if name is not None:
            parse_name(name)
        if ref.kind in ("host", "name"):
            raise ImageError(f"{str(ref)!r} is not an image source: import one of dir:, oci:, "
                             f"oci-archive:, docker-archive:, debian:")
        ref = _absolute(ref)
        say = progress or (lambda p: None)
        self._ensure()
        with self._lock(self._path("store.lock"), fcntl.LOCK_SH):
            if ref.kind == "debian":
                record, held = self._debian(ref, say)
            elif ref.kind == "dir":
                record, held = self._dir(ref, say)
            else:
                with oci.open_source(ref) as source:
                    record, held = self._from_source(source, oci.read_image(source, ref), say)
            try:  # the tree stays held until a name refers to it: gc cannot take it between
                record = self._record_once(self._path("sources", _source_key(ref)),
                                           {**record, "source": str(ref)})
                if name is not None:
                    self._record_once(self._path("refs", name), {**record, "name": name})
            finally:
                os.close(held)
        return self._image(record, name)

    def _from_source(self, source: oci.Source, image: oci.SourceImage,
                     say: Progress) -> tuple[dict, int]:
        config_digest = self.layers.put_bytes(image.config, image.config_digest,
                                        f"{source.label}: the config")
        config = oci.config_json(image.config, source.label)
        diff_ids = oci.diff_ids(config, len(image.layers), source.label)
        chain_id = chain_ids(diff_ids)[-1]
        count = len(image.layers)

        def layers() -> Iterator[Callable[[int, str, Building], str]]:
            for number, layer in enumerate(image.layers, 1):
                yield functools.partial(self.layers.from_source, source, layer,
                                        functools.partial(_layer_progress, say, number, count))

        return self._tree(chain_id, diff_ids, config_digest, layers, say)

    def _tree(self, chain_id: str, diff_ids: tuple[str, ...], config_digest: str,
              layers: Callable[[], Iterator[Callable[[int, str, Building], str]]],
              say: Progress) -> tuple[dict, int]:
        """The record of the tree for chain_id: found, or built from layers() under the
        tree's build lock (each item applies one layer onto a root fd, checked against its
        diff_id, and gives the blob's digest in the store); and the fd of the tree's lock,
        held shared (the caller closes it)."""
        key = self._tree_key(chain_id)
        held = self._flock(self._path("locks", key), fcntl.LOCK_SH)
        assert held is not None
        try:
            # One builder per tree: a second import of it waits here, then finds it built.
            with self._lock(self._path("locks", key + ".build"), fcntl.LOCK_EX):
                holder = self._path("trees", key)
                if not os.path.isdir(holder):
                    self._build(holder, chain_id, diff_ids, config_digest, layers, say)
                with open(os.path.join(holder, "image.json")) as f:
                    built = json.load(f)
        except BaseException:
            os.close(held)
            raise
        return {"chain_id": chain_id, "tree": key, "config_digest": config_digest,
                "diff_ids": list(diff_ids), "layers": built["layers"],
                "size": built["size"]}, held

    def _build(self, holder: str, chain_id: str, diff_ids: tuple[str, ...],
               config_digest: str, layers: Callable[[], Iterator[Callable[[int, str, Building], str]]],
               say: Progress) -> None:
        tmp = self._path("tmp", f"tree-{os.getpid()}-{secrets.token_hex(8)}")
        os.mkdir(tmp, 0o700)
        try:
            os.mkdir(os.path.join(tmp, "rootfs"), 0o755)
            root_fd = os.open(os.path.join(tmp, "rootfs"),
                              os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if self._ids is not None:
                    os.fchown(root_fd, *self._ids(0, 0))  # the image's root owns its /
                tree = Building()
                with pooled():  # each layer's reads in the buffers of the reads before
                    blobs = [apply(root_fd, diff_id, tree)
                             for apply, diff_id in zip(layers(), diff_ids, strict=True)]
                say(ImportProgress("manifest"))
                text, size = manifest_file(root_fd, tree.hashes)
            finally:
                os.close(root_fd)
            write_file(os.path.join(tmp, "manifest.jsonl"), text)
            write_file(os.path.join(tmp, "image.json"), json.dumps(
                {"chain_id": chain_id, "diff_ids": list(diff_ids), "layers": blobs,
                 "config_digest": config_digest, "size": size}, indent=1, sort_keys=True))
            # Every file of the tree reaches the disk before the name of the tree does:
            # syncfs of the store's own filesystem (os.sync would flush every one).
            syncfs(tmp)
            os.chmod(tmp, 0o755)
            os.rename(tmp, holder)
            fsync_dir(os.path.dirname(holder))
        except BaseException:
            remove(tmp)
            raise

    def _dir(self, ref: ImageRef, say: Progress) -> tuple[dict, int]:
        """dir:PATH: the tree is hashed, not trusted: written as one tar layer, which is
        then unpacked like any other (karotte/images/sources.py)."""
        return self._one_layer(functools.partial(sources.dir_layer, str(ref.path)),
                               sources.DIR_RUN, say)

    def _debian(self, ref: ImageRef, say: Progress) -> tuple[dict, int]:
        """debian:SUITE+PKG,...: built by mmdebstrap, once per (suite, packages): a second
        process importing the same source waits for the first's build and uses it."""
        record = self._path("sources", _source_key(ref))
        with self._lock(self._path("locks", f"source-{_source_key(ref)}.build"),
                        fcntl.LOCK_EX):
            cached = self._read_record(record)
            if cached is not None:
                with contextlib.suppress(ImageNotFound):
                    return cached, self._hold(cached["tree"], str(ref))
            say(ImportProgress("build"))
            made = self._one_layer(functools.partial(sources.debian_layer, ref),
                                   sources.DEBIAN_RUN, say)
            # Recorded here, under the build lock: a process that waited finds it.
            self._write_record(record, {**made[0], "source": str(ref), "created": time.time()})
            return made

    def _one_layer(self, make: Callable[[str], None], run: dict,
                   say: Progress) -> tuple[dict, int]:
        """The record of a one-layer image made here: make(path) writes an uncompressed
        tar, whose diff_id is its blob digest, and a config is written for it."""
        tmp = self._path("tmp", f"layer-{os.getpid()}-{secrets.token_hex(8)}.tar")
        try:
            make(tmp)
            with open(tmp, "rb") as f:
                digest = self.layers.put_file(f, "a layer made here")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        config = json.dumps({"architecture": oci.host_arch(), "os": "linux", "config": run,
                             "rootfs": {"type": "layers", "diff_ids": [digest]}},
                            sort_keys=True).encode()
        config_digest = self.layers.put_bytes(config, None, "config")

        def layers() -> Iterator[Callable[[int, str, Building], str]]:
            yield functools.partial(self.layers.from_blob, digest, "tar",
                                    functools.partial(_layer_progress, say, 1, 1))

        return self._tree(digest, (digest,), config_digest, layers, say)

    # -- records --------------------------------------------------------------------

    def _write_record(self, path: str, record: dict) -> None:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = self._path("tmp", f"ref-{os.getpid()}-{secrets.token_hex(8)}")
        write_file(tmp, json.dumps(record, indent=1, sort_keys=True))
        os.rename(tmp, path)
        fsync_dir(os.path.dirname(path))

    def _record_once(self, path: str, record: dict) -> dict:
        """record at path, written with the time unless what is there already says the
        same: a cache hit (every sandbox on a source ref leases through one) then writes
        and syncs nothing, which was 1 ms of each such sandbox's start (docs/benchmarks.md)."""
        def timeless(r: dict) -> dict:
            return {k: v for k, v in r.items() if k != "created"}

        old = self._read_record(path)
        if old is not None and timeless(old) == timeless(record):
            return old
        record = {**timeless(record), "created": time.time()}
        self._write_record(path, record)
        return record

    def _read_record(self, path: str) -> dict | None:
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ImageError(f"the image record {path} is unreadable ({exc}); remove it "
                             f"and import the image again") from None

    def _image(self, record: dict, name: str | None) -> Image:
        digest = record["config_digest"]
        config = _CONFIGS.get(digest)
        if config is None:  # a blob is its digest's for good: parsed once per process
            with open(self.layers.path(digest), "rb") as f:
                config = _CONFIGS[digest] = oci.config_json(f.read(oci.MAX_JSON),
                                                           record["source"])
        run = config.get("config") or {}
        return Image(
            name=name, source=record["source"], chain_id=record["chain_id"],
            tree=self._path("trees", record["tree"], "rootfs"),
            config=ImageConfig(env=tuple(run.get("Env") or ()),
                               working_dir=run.get("WorkingDir") or None,
                               user=run.get("User") or None,
                               entrypoint=tuple(run.get("Entrypoint") or ()),
                               cmd=tuple(run.get("Cmd") or ())),
            config_digest=record["config_digest"], layers=tuple(record["layers"]),
            diff_ids=tuple(record["diff_ids"]), size=record["size"],
            created=record["created"])

    def _record(self, ref: ImageRef | str) -> tuple[dict, str | None]:
        ref = parse(ref) if isinstance(ref, str) else ref
        if ref.kind == "host":
            raise ImageError("'host' is the host's own userland, not an image in the store")
        if ref.kind == "name":
            record = self._read_record(self._path("refs", str(ref.name)))
            if record is None:
                raise ImageNotFound(f"no image named {ref.name!r} in {self.root}; import one "
                                    f"with --name {ref.name} (names: "
                                    f"{', '.join(i.name or '' for i in self.ls()) or 'none'})")
            return record, ref.name
        record = self._read_record(self._path("sources", _source_key(_absolute(ref))))
        if record is None:
            raise ImageNotFound(f"{ref} was not imported into {self.root}; import it first")
        return record, None

    # -- the public operations ----------------------------------------------------------

    def open_image(self, ref_or_name: ImageRef | str) -> Image:
        """The image of a name, or of a source ref (imported now if it is not here: a
        cache hit when its tree is)."""
        ref = parse(ref_or_name) if isinstance(ref_or_name, str) else ref_or_name
        if ref.kind in ("name", "host"):
            record, name = self._record(ref)
            if not os.path.isdir(self._path("trees", record["tree"])):
                raise ImageNotFound(f"the tree of {ref} is gone from {self.root} (removed by "
                                    f"hand?); import it again from {record['source']}")
            return self._image(record, name)
        if ref.kind == "debian":  # built once per source and never again (_debian): the
            # record is the image, read as a name's is, with no lock or write (a lease
            # holds the tree, or imports again if gc took it meanwhile)
            with contextlib.suppress(ImageNotFound):
                record, name = self._record(ref)
                if os.path.isdir(self._path("trees", record["tree"])):
                    return self._image(record, name)
        return self.import_image(ref)

    def holds(self, ref_or_name: ImageRef | str) -> bool:
        """Whether the tree of a name, or of a source imported before, is in the store:
        open_image of it is then a cache hit. Imports nothing."""
        try:
            record, _ = self._record(ref_or_name)
        except ImageNotFound:
            return False
        return os.path.isdir(self._path("trees", record["tree"]))

    @contextlib.contextmanager
    def use(self, image: Image) -> Iterator[Image]:
        """Hold image's tree for as long as the block runs: gc leaves it alone (a shared
        flock on the tree's lock file, released when the block ends or the process dies)."""
        fd = self._hold(os.path.basename(os.path.dirname(image.tree)),
                        image.name or image.source)
        try:
            yield image
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def lease(self, ref_or_name: ImageRef | str) -> Iterator[Image]:
        """open_image and use in one: the image, its tree held until the block ends."""
        ref = parse(ref_or_name) if isinstance(ref_or_name, str) else ref_or_name
        image = self.open_image(ref)
        key = os.path.basename(os.path.dirname(image.tree))
        try:
            fd = self._hold(key, str(ref))
        except ImageNotFound:
            if ref.kind == "name":
                raise
            image = self.open_image(ref)  # gc took an unnamed tree just now: import again
            fd = self._hold(os.path.basename(os.path.dirname(image.tree)), str(ref))
        try:
            yield image
        finally:
            os.close(fd)

    def ls(self) -> tuple[Image, ...]:
        """The named images, by name."""
        refs = self._path("refs")
        found = []
        for dirpath, _, files in os.walk(refs):
            for file in files:
                name = os.path.relpath(os.path.join(dirpath, file), refs)
                record = self._read_record(os.path.join(dirpath, file))
                if record is not None:
                    found.append(self._image(record, name))
        return tuple(sorted(found, key=lambda i: i.name or ""))

    def inspect(self, ref_or_name: ImageRef | str) -> Image:
        """The image a name (or an imported source) refers to; imports nothing."""
        record, name = self._record(ref_or_name)
        return self._image(record, name)

    def rm(self, name: str) -> None:
        """Remove a name. Its tree and blobs stay until gc finds nothing else refers to them."""
        parse_name(name)
        path = self._path("refs", name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            raise ImageNotFound(f"no image named {name!r} in {self.root}") from None
        parent = os.path.dirname(path)
        while parent != self._path("refs") and not os.listdir(parent):
            os.rmdir(parent)
            parent = os.path.dirname(parent)

    def verify(self, ref_or_name: ImageRef | str) -> Verification:
        """Walk the tree again and compare it with the manifest written when it was built."""
        record, _ = self._record(ref_or_name)
        holder = self._path("trees", record["tree"])
        with open(os.path.join(holder, "manifest.jsonl")) as f:
            expected = {e["path"]: e for e in map(json.loads, f)}
        fd = os.open(os.path.join(holder, "rootfs"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            found = {e.path: entry_dict(e) for e in manifest(fd)}
        finally:
            os.close(fd)
        problems = [f"{p}: missing" for p in sorted(expected.keys() - found.keys())]
        problems += [f"{p}: not in the manifest" for p in sorted(found.keys() - expected.keys())]
        for path in sorted(expected.keys() & found.keys()):
            changed = [f"{k} {expected[path][k]!r} -> {found[path][k]!r}"
                       for k in expected[path] if expected[path][k] != found[path].get(k)]
            if changed:
                problems.append(f"{path}: {', '.join(changed)}")
        return Verification(record["chain_id"], os.path.join(holder, "rootfs"), len(found),
                            tuple(problems))


def _layer_progress(say: Progress, number: int, count: int, done: int,
                    total: int | None) -> None:
    say(ImportProgress("layer", number, count, done, total))


def _absolute(ref: ImageRef) -> ImageRef:
    """ref with its path made absolute: the same source from any working directory."""
    if ref.path is None:
        return ref
    return dataclasses.replace(ref, path=os.path.abspath(ref.path))


def _source_key(ref: ImageRef) -> str:
    return hashlib.sha256(str(ref).encode()).hexdigest()
