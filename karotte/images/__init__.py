"""Images: a task's own root filesystem, imported into a content-addressed store.

    parse("oci:/srv/layouts/tb2:chess") -> ImageRef      the one grammar (ref.py)
    import_image(ref, name=None) -> Image                 verify, unpack, record (store.py)
    open_image(ref_or_name) -> Image                      by name, or imported now if need be
    lease(ref_or_name)                                    a block during which gc keeps the tree

The formats (oci.py), the store's layout, verification and the threat model of import are
in docs/images.md.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from .oci import DigestMismatch, ImageError
from ..imageref import GRAMMAR, ImageRef, ImageRefError, parse, parse_name
from .store import (GcResult, Image, ImageConfig, ImageNotFound, ImportProgress, Store,
                    Verification, default_root)

__all__ = ["GRAMMAR", "DigestMismatch", "GcResult", "Image", "ImageConfig", "ImageError",
           "ImageNotFound", "ImageRef", "ImportProgress", "ImageRefError", "Store", "Verification",
           "default_root", "default_store", "import_image", "lease", "open_image", "parse",
           "parse_name"]


def default_store() -> Store:
    """The store at default_root(): $KAROTTE_IMAGE_DIR, /var/lib/karotte/images for root,
    else $XDG_CACHE_HOME/karotte/images."""
    return Store(default_root())


def import_image(ref: ImageRef | str, name: str | None = None) -> Image:
    """Import ref into the default store (a cache hit when its tree is there already)."""
    return default_store().import_image(ref, name)


def open_image(ref_or_name: ImageRef | str) -> Image:
    """The image of a name, or of a source ref (imported if it is not in the store yet)."""
    return default_store().open_image(ref_or_name)


@contextlib.contextmanager
def lease(ref_or_name: ImageRef | str) -> Iterator[Image]:
    """The image of ref_or_name with its tree held until the block ends: what a sandbox
    holds for its life (Image.tree is the overlay's lower; Image.config has Env and
    WorkingDir)."""
    with default_store().lease(ref_or_name) as image:
        yield image
