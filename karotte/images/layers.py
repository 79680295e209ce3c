"""Layers into the store and onto a tree: each layer blob is hashed while the same reads
are extracted (a thread hashes, the caller's thread extracts), and the uncompressed stream
is checked against the config's diff_id. A layer of an image source is not kept in blobs/:
the source has it, and the tree is what sandboxes use (keeping it doubled the store's
size and an import's writes); a zstd layer is (the `zstd` command reads a real file), and
so are the layers Karotte makes itself (`dir:`, `debian:`; put_file).

Each byte of a layer is read from the source once. An uncompressed layer's blob digest is
its diff_id: it is hashed once, by that thread. A compressed one is hashed twice (the blob,
then the stream as it is fed to extract.apply_layer), as the two digests name different
bytes. Extraction does not wait for the blob's digest: the tree is built in the store's
tmp/ and kept only if every digest matches, and a forged blob that makes extraction
refuse an entry is still reported by its digest (DigestMismatch). A zstd layer is copied
whole first, then extracted from the copy.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import secrets
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO, Callable

from . import oci
from .blobs import BlobCopy, Tee
from .extract import LayerBudget, apply_layer
from .oci import DigestMismatch
from .tree import CHUNK

LayerProgress = Callable[[int, "int | None"], None]  # (bytes read of the blob, its size)


@dataclass
class Building:
    """What the layers applied so far made of a tree being built (from empty): each file's
    sha256 by inode, for its manifest, and the bytes of its files, for the next layer's
    budget."""

    hashes: dict[int, tuple[int, str]] = field(default_factory=dict)
    bytes: int = 0


class Layers:
    """The store's blobs/ (under root) and the layers unpacked through it."""

    def __init__(self, root: str, budget: LayerBudget,
                 ids: Callable[[int, int], tuple[int, int]] | None):
        self.blobs = os.path.join(root, "blobs", "sha256")
        self.tmp = os.path.join(root, "tmp")
        self.budget, self.ids = budget, ids
        self.extractions = 0  # layers unpacked (a cache hit unpacks none)

    def path(self, digest: str) -> str:
        return os.path.join(self.blobs, oci.digest_hex(digest, "blob"))

    def from_source(self, source: oci.Source, layer: oci.Layer, say: LayerProgress,
                    root_fd: int, diff_id: str, tree: Building) -> str:
        """One layer of source onto the tree at root_fd, its blob hashed from the same
        reads (kept in blobs/ only for zstd); the blob's digest. A blob already in the
        store is read there."""
        what = f"{source.label}: layer {layer.where}"
        compression = layer.compression or "sniff"
        if layer.digest is not None and os.path.exists(self.path(layer.digest)):
            return self.from_blob(layer.digest, compression, say, root_fd, diff_id, tree)
        tmp = self._tmp()
        with source.open(layer.where) as f:
            if compression == "sniff":
                compression = oci.sniff(f.read(4))
                f.seek(0)
            # Only zstd's is kept (it reads a real file); any other is hashed, not copied.
            copy = BlobCopy(tmp if compression == "zstd" else None)
            try:
                return self._through(f, copy, tmp, compression, layer, what, say, root_fd,
                                     diff_id, tree)
            finally:
                copy.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def _through(self, f: IO[bytes], copy: BlobCopy, tmp: str, compression: str,
                 layer: oci.Layer, what: str, say: LayerProgress, root_fd: int, diff_id: str,
                 tree: Building) -> str:
        """from_source's layer as its source file f is read once: hashed (and for zstd
        copied) by copy's thread while it is extracted; its blob's digest."""
        tee = Tee(f, copy, say, _size(f))
        if compression == "zstd":  # zstd reads a real file: the copy, once whole
            tee.drain()
            digest = self._adopt(copy, tmp, layer.digest, what)
            return self.from_blob(digest, compression, say, root_fd, diff_id, tree)
        try:
            stream_digest = self._extract(tee, compression, root_fd, tree)
            tee.drain()  # past the end of a gzip stream too: the blob is hashed whole
        except BaseException:
            # A forged blob is named as one, not by what it made extraction refuse.
            actual = None
            with contextlib.suppress(Exception):
                tee.drain()
                actual = copy.finish()
            if layer.digest is not None and actual not in (None, layer.digest):
                raise DigestMismatch(f"{what}: blob {layer.digest}", layer.digest,
                                     str(actual)) from None
            raise
        digest = self._adopt(copy, tmp, layer.digest, what)
        _check_diff_id(digest, stream_digest or digest, diff_id)
        return digest

    def from_blob(self, digest: str, compression: str, say: LayerProgress, root_fd: int,
                  diff_id: str, tree: Building) -> str:
        """The layer whose blob is in the store (verified when it came) onto the tree."""
        with open(self.path(digest), "rb") as blob:
            if compression == "sniff":
                compression = oci.sniff(blob.read(4))
                blob.seek(0)
            if compression == "zstd":
                found = self._extract(blob, compression, root_fd, tree)
            else:
                found = self._extract(Tee(blob, None, say, os.fstat(blob.fileno()).st_size),
                                      compression, root_fd, tree)
        _check_diff_id(digest, found or digest, diff_id)
        return digest

    def _extract(self, raw: Tee | BinaryIO, compression: str, root_fd: int, tree: Building) -> str | None:
        """Extract the layer whose blob raw reads, to its end; the digest of its
        uncompressed stream, or None where that is the blob's own ("tar")."""
        with oci.uncompressed(raw, compression) as stream:
            hashing = None if compression == "tar" else _Hashing(stream)
            tree.bytes = apply_layer(hashing or stream, root_fd, budget=self.budget,
                                     ids=self.ids, hashes=tree.hashes, tree_bytes=tree.bytes)
            (hashing or raw).drain()  # the diff_id covers the tar's end blocks too
        self.extractions += 1
        return None if hashing is None else hashing.digest()

    def _adopt(self, copy: BlobCopy, tmp: str, expected: str | None, what: str) -> str:
        """The finished copy's digest, unless not expected; a copy written to tmp is
        renamed into blobs/ under it."""
        actual = copy.finish()
        if expected is not None and actual != expected:
            raise DigestMismatch(f"{what}: blob {expected}", expected, actual)
        if copy.path is not None:
            os.chmod(tmp, 0o444)
            os.rename(tmp, self.path(actual))
        return actual

    def put_bytes(self, data: bytes, expected: str | None, what: str) -> str:
        """A small blob (a config) into blobs/, unless its digest is not expected."""
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if expected is not None and actual != expected:
            raise DigestMismatch(f"{what}: blob {expected}", expected, actual)
        if not os.path.exists(self.path(actual)):
            self.put_file(io.BytesIO(data), what)
        return actual

    def put_file(self, f: IO[bytes], what: str) -> str:
        """Copy f into blobs/; its digest."""
        tmp = self._tmp()
        copy = BlobCopy(tmp)
        try:
            copy.start(f)
            while copy.get() is not None:
                pass
            return self._adopt(copy, tmp, None, what)
        finally:
            copy.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _tmp(self) -> str:
        return os.path.join(self.tmp, f"blob-{os.getpid()}-{secrets.token_hex(8)}")


def _check_diff_id(digest: str, found: str, diff_id: str) -> None:
    if found != diff_id:
        raise DigestMismatch(f"layer {digest} uncompressed does not match the config's "
                             f"diff_id", diff_id, found)


def _size(f: IO[bytes]) -> int | None:
    """Bytes of a seekable source file (a layout's blob, an archive's member)."""
    try:
        size = f.seek(0, io.SEEK_END)
        f.seek(0)
    except (OSError, ValueError):
        return None
    return size


class _Hashing:
    """A read-only stream that hashes what passes through it."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read(n)
        self._sha.update(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        while self.read(CHUNK):
            pass

    def digest(self) -> str:
        return "sha256:" + self._sha.hexdigest()
