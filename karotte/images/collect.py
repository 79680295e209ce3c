"""The image store's gc (karotte/images/store.py's Store): what no name refers to is
removed, trees in use (their lock held shared) and, while an import is under way, every
blob are kept; a tree is renamed into tmp/ before it is removed, so that no later use
finds it half gone; records of sources whose tree is gone are dropped.

Collecting is a part of Store: it uses its _ensure, _path, _lock and _read_record.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from dataclasses import dataclass

from .blobs import remove


@dataclass(frozen=True)
class GcResult:
    """What `Store.gc` removed, and what it left because a sandbox or an import held it."""

    trees_removed: tuple[str, ...]
    blobs_removed: tuple[str, ...]
    bytes_freed: int
    trees_in_use: tuple[str, ...]
    blobs_skipped: bool  # an import was under way: no blob was removed this time


class Collecting:
    """The gc half of Store."""

    def gc(self) -> GcResult:
        """Remove the trees and blobs that no name refers to, except trees in use (their
        lock held shared) and, while an import is under way, any blob."""
        self._ensure()
        removed, in_use, freed = [], [], 0
        for key in sorted(os.listdir(self._path("trees"))):
            if key in self._named()[0]:
                continue
            with self._lock(self._path("locks", key), fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
                if not taken:
                    in_use.append(key)
                    continue
                if key in self._named()[0]:  # named while we waited for nothing: keep it
                    continue
                doomed = self._path("tmp", f"gc-{key}-{secrets.token_hex(4)}")
                os.rename(self._path("trees", key), doomed)  # gone for every later use
                freed += remove(doomed)
                removed.append(key)
                for path in (self._path("locks", key), self._path("locks", key + ".build")):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
        self._drop_sources()
        blobs_removed: list[str] = []
        with self._lock(self._path("store.lock"), fcntl.LOCK_EX | fcntl.LOCK_NB) as alone:
            if alone:
                keep = self._named()[1]
                for hex_ in sorted(os.listdir(self._path("blobs", "sha256"))):
                    if f"sha256:{hex_}" not in keep:
                        path = self._path("blobs", "sha256", hex_)
                        freed += os.stat(path).st_size
                        os.unlink(path)
                        blobs_removed.append(f"sha256:{hex_}")
                for left in os.listdir(self._path("tmp")):  # no import runs: all leftovers
                    freed += remove(self._path("tmp", left))
        return GcResult(tuple(removed), tuple(blobs_removed), freed, tuple(in_use), not alone)

    def _named(self) -> tuple[set[str], set[str]]:
        """The tree keys and the blob digests that names refer to."""
        trees, blobs = set(), set()
        refs = self._path("refs")
        for dirpath, _, files in os.walk(refs):
            for file in files:
                record = self._read_record(os.path.join(dirpath, file))
                if record is not None:
                    trees.add(record["tree"])
                    blobs.update([record["config_digest"], *record["layers"]])
        return trees, blobs

    def _drop_sources(self) -> None:
        for file in os.listdir(self._path("sources")):
            path = self._path("sources", file)
            record = self._read_record(path)
            if record is None or not os.path.isdir(self._path("trees", record["tree"])):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
