"""Readers of the image formats Karotte imports: an OCI image layout directory, a tar of
one (oci-archive), and `docker save` output in both its forms (the legacy manifest.json
and Docker 25's OCI layout in the tar). Each gives the same `Image`: the config's bytes and
the layers' descriptors, opened as raw streams; the store verifies every digest.

Archives are read in place (tarfile's random access on the seekable file), never
extracted to disk. Layers are tar, tar+gzip or tar+zstd; zstd goes through `zstd -dc`,
the standard library having none.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import tarfile
import zlib
from dataclasses import dataclass
from typing import IO, Any, BinaryIO, Iterator

from ..errors import KarotteError
from ..imageref import ImageRef

MAX_JSON = 4 << 20  # index, manifest and config: bytes read at most (they are small)
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")
_MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                   "application/vnd.docker.distribution.manifest.v2+json")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386",
         "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}
_REF_NAME = "org.opencontainers.image.ref.name"
GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"


class ImageError(KarotteError):
    """An image that cannot be read or imported; the message names the cause and the fix."""


class DigestMismatch(ImageError):
    """Content whose sha256 is not the digest that names it (a corrupt or forged blob)."""

    def __init__(self, what: str, expected: str, actual: str):
        super().__init__(f"{what}: expected {expected}, got {actual}; the image is corrupt "
                         f"or was altered: export it again from a source you trust")
        self.expected, self.actual = expected, actual


@dataclass(frozen=True)
class Layer:
    """One layer as the image lists it: where it is in the source, the blob's digest (None
    where the format gives none: the legacy `<id>/layer.tar`), and its compression ("tar",
    "gzip", "zstd"; None: told by its first bytes)."""

    where: str
    digest: str | None
    compression: str | None


@dataclass(frozen=True)
class SourceImage:
    """An image as its source describes it, before anything is verified by the store."""

    config: bytes  # the config blob, exactly as stored
    config_digest: str | None  # None where the format gives none
    layers: tuple[Layer, ...]
    tags: tuple[str, ...]  # the tags the source gives it


def host_arch() -> str:
    """This host's architecture as OCI platforms name it."""
    machine = platform.machine()
    return _ARCH.get(machine, machine)


def digest_hex(digest: object, what: str) -> str:
    """The hex of a "sha256:<hex>" digest; refuses anything else (which would also be an
    unsafe path in blobs/)."""
    m = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if m is None:
        raise ImageError(f"{what}: digest {digest!r} is not sha256:<64 hex digits>; "
                         f"Karotte reads sha256 digests only")
    return m.group(1)


def compression_of(media_type: str) -> str:
    """A layer media type's compression: "tar", "gzip" or "zstd"."""
    if media_type.endswith(("+gzip", ".gzip")):
        return "gzip"
    if media_type.endswith(("+zstd", ".zstd")):
        return "zstd"
    if media_type.endswith((".tar", "v1.tar", "diff.tar")):
        return "tar"
    raise ImageError(f"layer media type {media_type!r} is none of tar, tar+gzip, tar+zstd; "
                     f"convert the image (e.g. skopeo copy --dest-compress-format gzip)")


class Source:
    """An opened image source (a layout directory or an archive); a context manager."""

    label: str

    def read(self, where: str, limit: int = MAX_JSON) -> bytes:
        with self.open(where) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ImageError(f"{self.label}: {where} is over {limit} bytes; not an image file")
        return data

    def open(self, where: str) -> BinaryIO:
        raise NotImplementedError

    def exists(self, where: str) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def json(self, where: str) -> Any:
        try:
            return json.loads(self.read(where))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ImageError(f"{self.label}: {where} is not JSON ({exc})") from None


class LayoutDir(Source):
    """An OCI image layout directory (oci:PATH)."""

    def __init__(self, path: str):
        self.label = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ImageError(f"cannot open the OCI layout {path!r}: {exc.strerror}; give the "
                             f"directory that holds oci-layout and index.json") from None

    def open(self, where: str) -> BinaryIO:
        # Names come from digests checked by digest_hex (or are fixed), so they stay
        # inside the layout; O_NOFOLLOW refuses a blob that is a symlink to elsewhere.
        try:
            fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            raise ImageError(f"{self.label}: cannot open {where}: {exc.strerror}") from None
        return os.fdopen(fd, "rb")

    def exists(self, where: str) -> bool:
        try:
            os.stat(where, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def close(self) -> None:
        os.close(self.fd)


class Archive(Source):
    """An uncompressed tar (oci-archive, docker-archive), read in place by member name."""

    def __init__(self, path: str):
        self.label = path
        try:
            self.tar = tarfile.open(path, "r:")
        except OSError as exc:
            raise ImageError(f"cannot open the archive {path!r}: {exc.strerror}") from None
        except tarfile.TarError as exc:
            raise ImageError(f"{path!r} is not an uncompressed tar ({exc}); decompress it "
                             f"first (docker save and skopeo write plain tars)") from None
        self.members: dict[str, tarfile.TarInfo] = {}
        for member in self.tar.getmembers():
            self.members.setdefault(_member_name(member.name), member)

    def open(self, where: str) -> BinaryIO:
        member = self.members.get(where)
        if member is None or not (member.isfile() or member.issym() or member.islnk()):
            raise ImageError(f"{self.label}: the archive has no file {where}")
        if member.isreg() and not member.issparse():
            return _Region(self.tar.fileobj.fileno(), member.offset_data,  # type: ignore[union-attr, return-value]
                           member.size)
        try:
            f = self.tar.extractfile(member)  # a link resolves to a member of this tar only
        except KeyError:
            f = None
        if f is None:
            raise ImageError(f"{self.label}: {where} is a link to nothing in the archive")
        return f  # type: ignore[return-value]

    def exists(self, where: str) -> bool:
        return where in self.members

    def close(self) -> None:
        self.tar.close()


class _Region(io.RawIOBase):
    """The bytes of one member of an uncompressed archive, read in place with pread: a
    layer of a docker-archive goes from the archive straight into the reader's buffer
    (readinto), not through tarfile's own buffers and copies. The archive's fd stays the
    archive's."""

    def __init__(self, fd: int, start: int, size: int):
        super().__init__()
        self._fd, self._start, self._size, self._at = fd, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._size - self._at)
        if n <= 0:
            return 0
        with memoryview(buffer) as view:
            got = os.preadv(self._fd, [view[:n]], self._start + self._at)
        self._at += got
        return got

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._at if n is None or n < 0 else min(n, self._size - self._at)
        data = os.pread(self._fd, n, self._start + self._at) if n > 0 else b""
        self._at += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"a negative position {base + offset}")
        self._at = base + offset
        return self._at

    def tell(self) -> int:
        return self._at


def _member_name(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/")


def open_source(ref: ImageRef) -> Source:
    """The source of an oci, oci-archive or docker-archive reference."""
    if ref.kind == "oci":
        return LayoutDir(str(ref.path))
    if ref.kind in ("oci-archive", "docker-archive"):
        return Archive(str(ref.path))
    raise ValueError(f"{ref.kind} images have no format reader")


def read_image(source: Source, ref: ImageRef) -> SourceImage:
    """The image that ref names in source: by tag, and for this host's platform."""
    if ref.kind == "docker-archive" and source.exists("manifest.json"):
        return _docker_manifest(source, ref.tag)
    if not source.exists("index.json"):
        raise ImageError(f"{source.label}: no index.json (nor manifest.json); not an OCI image "
                         f"layout or docker-archive")
    return _from_layout(source, ref.tag)


def _from_layout(source: Source, tag: str | None) -> SourceImage:
    index = _as_dict(source.json("index.json"), source, "index.json")
    descriptors = _manifests(index, source, "index.json")
    if tag is not None:
        chosen = [d for d in descriptors if d.get("annotations", {}).get(_REF_NAME) == tag]
        if not chosen:
            raise ImageError(f"{source.label}: no image tagged {tag!r}; tags: "
                             f"{', '.join(_tags(descriptors)) or 'none'}")
    elif len(_tags(descriptors)) > 1:
        raise ImageError(f"{source.label} holds several images ({', '.join(_tags(descriptors))}); "
                         f"name one with :TAG")
    else:
        chosen = descriptors
    descriptor = _platform(chosen, source, "index.json")
    tags = tuple(t for t in [descriptor.get("annotations", {}).get(_REF_NAME)] if t)
    for _ in range(8):
        media = descriptor.get("mediaType")
        data = _blob_json(source, descriptor, "manifest")
        media = media or data.get("mediaType")
        if media in _INDEX_TYPES or "manifests" in data:
            descriptor = _platform(_manifests(data, source, "an index"), source, "an index")
            continue
        if media not in _MANIFEST_TYPES and "layers" not in data:
            raise ImageError(f"{source.label}: {media!r} is not an image manifest or index")
        return _from_manifest(source, data, tags)
    raise ImageError(f"{source.label}: indexes nested more than 8 deep")


def _from_manifest(source: Source, manifest: dict, tags: tuple[str, ...]) -> SourceImage:
    config = manifest.get("config")
    layers = manifest.get("layers")
    if not isinstance(config, dict) or not isinstance(layers, list):
        raise ImageError(f"{source.label}: a manifest without config or layers")
    config_hex = digest_hex(config.get("digest"), f"{source.label}: the config")
    out = []
    for layer in layers:
        if not isinstance(layer, dict):
            raise ImageError(f"{source.label}: a layer descriptor that is not an object")
        hex_ = digest_hex(layer.get("digest"), f"{source.label}: a layer")
        out.append(Layer(f"blobs/sha256/{hex_}", f"sha256:{hex_}",
                         compression_of(str(layer.get("mediaType", "")))))
    return SourceImage(source.read(f"blobs/sha256/{config_hex}"), f"sha256:{config_hex}",
                 tuple(out), tags)


def _docker_manifest(source: Source, tag: str | None) -> SourceImage:
    entries = source.json("manifest.json")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ImageError(f"{source.label}: manifest.json is not a list of images")
    if tag is not None:
        want = _normal_repo_tag(tag)
        entries = [e for e in entries if want in map(_normal_repo_tag, e.get("RepoTags") or ())]
        if not entries:
            raise ImageError(f"{source.label}: no image tagged {tag!r}; tags: "
                             f"{_docker_tags(source) or 'none'}")
    elif len(entries) != 1:
        raise ImageError(f"{source.label} holds {len(entries)} images "
                         f"({_docker_tags(source) or 'untagged'}); name one with :REPO:TAG")
    entry = entries[0]
    config, layers = entry.get("Config"), entry.get("Layers")
    if not isinstance(config, str) or not isinstance(layers, list):
        raise ImageError(f"{source.label}: manifest.json has an image without Config or Layers")
    out = []
    for where in layers:
        if not isinstance(where, str):
            raise ImageError(f"{source.label}: manifest.json lists a layer that is no path")
        where = _member_name(where)
        # Docker 25's blobs/sha256/<hex> names the blob; legacy <id>/layer.tar names nothing
        # that can be checked here, and its diff_id is checked as it is unpacked.
        out.append(Layer(where, _path_digest(where, blob_only=True), None))
    config_where = _member_name(config)
    return SourceImage(source.read(config_where), _path_digest(config_where, blob_only=False),
                 tuple(out), tuple(entry.get("RepoTags") or ()))


def _path_digest(where: str, *, blob_only: bool) -> str | None:
    """The digest a docker-archive path states: blobs/sha256/<hex>, or (for the config,
    which legacy archives name by its digest) <hex>.json."""
    m = re.fullmatch(r"blobs/sha256/([0-9a-f]{64})", where)
    if m is None and not blob_only:
        m = re.fullmatch(r"([0-9a-f]{64})\.json", where)
    return f"sha256:{m.group(1)}" if m else None


def _normal_repo_tag(text: str) -> str:
    """docker.io/library/x:t for x:t, as Docker and skopeo write RepoTags."""
    repo, _, tag = text.rpartition(":")
    first = repo.split("/", 1)[0]
    if "/" not in repo or not ("." in first or ":" in first or first == "localhost"):
        repo = f"docker.io/{repo}"
    if repo.count("/") == 1 and repo.startswith("docker.io/"):
        repo = f"docker.io/library/{repo[len('docker.io/'):]}"
    return f"{repo}:{tag}"


def _docker_tags(source: Source) -> str:
    entries = source.json("manifest.json")
    return ", ".join(t for e in entries for t in (e.get("RepoTags") or ()))


def _as_dict(data: object, source: Source, what: str) -> dict:
    if not isinstance(data, dict):
        raise ImageError(f"{source.label}: {what} is not a JSON object")
    return data


def _manifests(index: dict, source: Source, what: str) -> list[dict]:
    descriptors = index.get("manifests")
    if not isinstance(descriptors, list) or not all(isinstance(d, dict) for d in descriptors):
        raise ImageError(f"{source.label}: {what} has no list of manifests")
    if not descriptors:
        raise ImageError(f"{source.label}: {what} lists no image")
    return descriptors


def _tags(descriptors: list[dict]) -> list[str]:
    return sorted({t for d in descriptors if (t := d.get("annotations", {}).get(_REF_NAME))})


def _platform(descriptors: list[dict], source: Source, what: str) -> dict:
    """The descriptor for linux on this host's architecture; one without a platform if it
    is the only candidate."""
    arch = host_arch()
    if len(descriptors) == 1 and "platform" not in descriptors[0]:
        return descriptors[0]
    platforms = [d.get("platform") if isinstance(d.get("platform"), dict) else {}
                 for d in descriptors]
    for descriptor, p in zip(descriptors, platforms):
        if p.get("os") == "linux" and p.get("architecture") == arch:
            return descriptor
    offered = sorted({f"{p.get('os')}/{p.get('architecture')}" for p in platforms})
    raise ImageError(f"{source.label}: {what} has no image for linux/{arch} (it has "
                     f"{', '.join(offered)}); export the one for this host's platform")


def _blob_json(source: Source, descriptor: dict, what: str) -> dict:
    hex_ = digest_hex(descriptor.get("digest"), f"{source.label}: a {what}")
    data = source.read(f"blobs/sha256/{hex_}")
    actual = _sha256(data)
    if actual != f"sha256:{hex_}":
        raise DigestMismatch(f"{source.label}: the {what} blob sha256:{hex_}",
                             f"sha256:{hex_}", actual)
    try:
        return _as_dict(json.loads(data), source, f"the {what} sha256:{hex_}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ImageError(f"{source.label}: the {what} sha256:{hex_} is not JSON ({exc})") from None


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sniff(head: bytes) -> str:
    """A layer's compression told by its first bytes."""
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    return "tar"


@contextlib.contextmanager
def uncompressed(blob: IO[bytes], compression: str) -> Iterator[BinaryIO]:
    """The uncompressed stream of a layer blob (a real file: zstd reads it as its stdin).
    A zstd that fails is an ImageError once the stream is done with."""
    if compression == "tar":
        yield blob  # type: ignore[misc]
    elif compression == "gzip":
        with gzip.GzipFile(fileobj=blob, mode="rb") as f:
            try:
                yield f  # type: ignore[misc]
            except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
                raise ImageError(f"a gzip layer does not decompress ({exc}); the blob is "
                                 f"corrupt: export the image again") from None
    elif compression == "zstd":
        zstd = shutil.which("zstd")
        if zstd is None:
            raise ImageError("a zstd layer needs the zstd command, which is not installed: "
                             "apt-get install zstd (scripts/setup installs it)")
        proc = subprocess.Popen([zstd, "-dcq"], stdin=blob, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        try:
            yield proc.stdout  # type: ignore[misc]
            while proc.stdout.read(1 << 20):  # what the reader left: zstd judges at the end
                pass
        finally:
            proc.stdout.close()
            err = proc.stderr.read(4096)
            proc.stderr.close()
            rc = proc.wait()
        if rc != 0:
            raise ImageError(f"a zstd layer does not decompress (zstd: "
                             f"{err.decode(errors='replace').strip()}); the blob is corrupt: "
                             f"export the image again")
    else:
        raise ValueError(f"compression {compression!r}")


def chain_ids(diff_ids: tuple[str, ...]) -> tuple[str, ...]:
    """The OCI chain id after each layer: sha256(parent chain id + " " + diff_id)."""
    out: list[str] = []
    for diff_id in diff_ids:
        out.append(diff_id if not out else
                   "sha256:" + hashlib.sha256(f"{out[-1]} {diff_id}".encode()).hexdigest())
    return tuple(out)


def config_json(data: bytes, label: str) -> dict:
    """An image config's JSON object (ImageError where it is none)."""
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ImageError(f"{label}: the image config is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ImageError(f"{label}: the image config is not a JSON object")
    return config


def diff_ids(config: dict, layers: int, label: str) -> tuple[str, ...]:
    """The config's rootfs.diff_ids, one per layer of the manifest, each a sha256 digest."""
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list):
        raise ImageError(f"{label}: the image config has no rootfs.diff_ids")
    for diff_id in diff_ids:
        digest_hex(diff_id, f"{label}: a diff_id")
    if len(diff_ids) != layers:
        raise ImageError(f"{label}: the manifest lists {layers} layers but the config "
                         f"{len(diff_ids)} diff_ids; the image is malformed")
    if not diff_ids:
        raise ImageError(f"{label}: the image has no layers (an empty root); add a layer")
    return tuple(diff_ids)
