"""`karotte image`: import, build, list, inspect, verify, remove and gc images of the store.

Each subcommand is one call of karotte.images' Store; `--json` prints its frozen record.
`import` and `build` draw a progress bar on stderr when it is a terminal (or with
`--progress`; never with `--no-progress`); stdout, and so `--json`, is left alone.
Exit status: 0, 1 when the store refuses (a bad digest, an unknown name, a tree that does
not match its manifest), 2 for bad usage (a reference outside the grammar).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from typing import Any, TextIO

from ..errors import KarotteError
from ..images import GRAMMAR, Image, ImageRefError, ImportProgress, default_store, parse

EXIT_REFUSED, EXIT_USAGE = 1, 2


def add_parser(sub) -> None:
    """The `image` command and its subcommands, on karotte's parser."""
    image = sub.add_parser("image", help="import and manage the images tasks run on",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description=f"An image reference is one of:\n{GRAMMAR}\n\nThe "
                                       "store: $KAROTTE_IMAGE_DIR, else /var/lib/karotte/"
                                       "images (root) or ~/.cache/karotte/images.")
    image.set_defaults(func=run)
    verbs = image.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("import", help="verify and unpack an image into the store")
    p.add_argument("ref", help="oci:PATH[:TAG], oci-archive:FILE, docker-archive:FILE, dir:PATH, "
                               "debian:SUITE[+PKG,...]")
    p.add_argument("--name", help="a name to refer to it by later (e.g. tb/chess)")
    p.add_argument("--json", action="store_true")
    _progress_options(p)
    p.set_defaults(verb_func=_import)
    p = verbs.add_parser("build", help="build a debian:SUITE[+PKG,...] image with mmdebstrap")
    p.add_argument("ref", help="debian:SUITE[+PKG,...], e.g. debian:bookworm+python3-pytest")
    p.add_argument("--name")
    p.add_argument("--json", action="store_true")
    _progress_options(p)
    p.set_defaults(verb_func=_build)
    p = verbs.add_parser("ls", help="the named images")
    p.add_argument("--json", action="store_true")
    p.set_defaults(verb_func=_ls)
    for verb, func, what in (("inspect", _inspect, "an image's config, layers and tree"),
                             ("verify", _verify, "walk an image's tree against its manifest")):
        p = verbs.add_parser(verb, help=what)
        p.add_argument("image", help="a name, or a reference imported before")
        p.add_argument("--json", action="store_true")
        p.set_defaults(verb_func=func)
    p = verbs.add_parser("rm", help="remove a name (gc removes what nothing refers to)")
    p.add_argument("name")
    p.set_defaults(verb_func=_rm)
    p = verbs.add_parser("gc", help="remove trees and blobs no name refers to, unless in use")
    p.add_argument("--json", action="store_true")
    p.set_defaults(verb_func=_gc)


def run(args: argparse.Namespace) -> int:
    try:
        return args.verb_func(args)
    except ImageRefError as exc:
        print(f"karotte image {args.verb}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (KarotteError, ValueError, OSError) as exc:
        print(f"karotte image {args.verb}: {exc}", file=sys.stderr)
        return EXIT_REFUSED


def _record(obj) -> dict:
    return dataclasses.asdict(obj)


def _line(image: Image) -> str:
    return (f"{image.name or '-'}  {image.chain_id[:19]}  {image.size / 2**20:.1f} MiB  "
            f"{image.source}")


def _progress_options(p: argparse.ArgumentParser) -> None:
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--progress", action="store_true", default=None,
                       help="draw the progress bar on stderr even when it is no terminal")
    shown.add_argument("--no-progress", action="store_false", dest="progress",
                       help="no progress bar")


def _import(args: argparse.Namespace) -> int:
    start = time.monotonic()
    shown = sys.stderr.isatty() if args.progress is None else args.progress
    bar = ProgressBar(sys.stderr, args.ref) if shown else None
    if bar is None and not args.json:
        print(f"importing {args.ref} ...", file=sys.stderr)
    try:
        image = default_store().import_image(args.ref, args.name, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps(_record(image)))
    else:
        print(f"{_line(image)}  ({time.monotonic() - start:.1f} s)")
    return 0


def _build(args: argparse.Namespace) -> int:
    if parse(args.ref).kind != "debian":
        print(f"karotte image build: {args.ref!r} is not a debian:SUITE[+PKG,...] reference; "
              "use `karotte image import` for the other forms", file=sys.stderr)
        return EXIT_USAGE
    return _import(args)


def _ls(args: argparse.Namespace) -> int:
    images = default_store().ls()
    if args.json:
        print(json.dumps([_record(i) for i in images]))
    else:
        for image in images:
            print(_line(image))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    image = default_store().inspect(args.image)
    if args.json:
        print(json.dumps(_record(image)))
        return 0
    print(_line(image))
    print(f"  tree     {image.tree}")
    print(f"  workdir  {image.config.working_dir or '-'}")
    print(f"  user     {image.config.user or '-'}")
    print(f"  cmd      {' '.join(image.config.entrypoint + image.config.cmd) or '-'}")
    for entry in image.config.env:
        print(f"  env      {entry}")
    for digest in image.layers:
        print(f"  layer    {digest}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    result = default_store().verify(args.image)
    if args.json:
        print(json.dumps({**_record(result), "ok": result.ok}))
    else:
        print(f"{result.tree}: {result.entries} entries, "
              f"{'as built' if result.ok else f'{len(result.problems)} problems'}")
        for problem in result.problems:
            print(f"  {problem}")
    return 0 if result.ok else EXIT_REFUSED


def _rm(args: argparse.Namespace) -> int:
    default_store().rm(args.name)
    return 0


def _gc(args: argparse.Namespace) -> int:
    result = default_store().gc()
    if args.json:
        print(json.dumps(_record(result)))
        return 0
    print(f"removed {len(result.trees_removed)} trees and {len(result.blobs_removed)} blobs, "
          f"{result.bytes_freed / 2**20:.1f} MiB; {len(result.trees_in_use)} in use kept"
          + ("; blobs kept: an import is under way" if result.blobs_skipped else ""))
    return 0


class ProgressBar:
    """The store's progress callback drawn as one line on stream: the step, a bar of the
    layer's bytes, and the seconds so far; redrawn at each new step or layer, at most
    every REDRAW seconds within one, and every TICK seconds by a thread of its own while
    a step gives no counts (mmdebstrap's build). close() clears the line."""

    REDRAW, TICK, WIDTH = 0.1, 0.5, 24

    def __init__(self, stream: TextIO, what: str):
        self._stream, self._what = stream, what
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self._last: ImportProgress | None = None
        self._drawn = 0.0
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="karotte-progress", daemon=True)
        self._ticker.start()

    def __call__(self, progress: ImportProgress) -> None:
        with self._lock:
            last, self._last = self._last, progress
            new = last is None or (last.step, last.layer) != (progress.step, progress.layer)
            if new or time.monotonic() - self._drawn >= self.REDRAW:
                self._draw()

    def _tick(self) -> None:
        while not self._stop.wait(self.TICK):
            with self._lock:
                if self._last is not None and self._last.step == "build":
                    self._draw()

    def _draw(self) -> None:
        p = self._last
        assert p is not None
        seconds = time.monotonic() - self._start
        if p.step == "build":
            text = "building it with mmdebstrap"
        elif p.step == "manifest":
            text = "writing the tree's manifest"
        else:
            text = f"layer {p.layer}/{p.layers} {self._bar(p.done, p.total)}"
        self._stream.write(f"\r\x1b[K{self._what}: {text}  {seconds:.1f} s")
        self._stream.flush()
        self._drawn = time.monotonic()

    def _bar(self, done: int, total: int | None) -> str:
        mib = f"{done / 2**20:.1f}"
        if not total:
            return f"{mib} MiB"
        filled = min(self.WIDTH, self.WIDTH * done // total)
        return (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {mib}/"
                f"{total / 2**20:.1f} MiB")

    def close(self) -> None:
        self._stop.set()
        self._ticker.join()
        with self._lock:
            if self._last is not None:
                self._stream.write("\r\x1b[K")
                self._stream.flush()


def announce_first_imports(env: Any, command: str, stream: TextIO = sys.stderr) -> None:
    """A line on stream for each image of env (image, grader_image) that the store has not
    imported yet: the first episode's import of it (a debian: build takes about a minute)
    is silent otherwise. Says nothing where it cannot tell (the episode reports errors)."""
    try:
        store = default_store()
        for ref in dict.fromkeys(r for r in (env.image, env.grader_image) if r):
            if parse(ref).kind in ("host", "dir", "name") or store.holds(ref):
                continue
            print(f"karotte {command}: importing {ref} into the image store for the first "
                  "time (a debian: build takes about a minute; later runs reuse it)",
                  file=stream, flush=True)
    except (KarotteError, ValueError, OSError, AttributeError):
        return
