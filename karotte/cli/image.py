"""`karotte image`: import, build, list, inspect, verify, remove and gc images of the store.

Each subcommand is one call of karotte.images' Store; `--json` prints its frozen record.
Exit status: 0, 1 when the store refuses (a bad digest, an unknown name, a tree that does
not match its manifest), 2 for bad usage (a reference outside the grammar).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from ..errors import KarotteError
from ..images import GRAMMAR, Image, ImageRefError, default_store, parse

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
    p.set_defaults(verb_func=_import)
    p = verbs.add_parser("build", help="build a debian:SUITE[+PKG,...] image with mmdebstrap")
    p.add_argument("ref", help="debian:SUITE[+PKG,...], e.g. debian:bookworm+python3-pytest")
    p.add_argument("--name")
    p.add_argument("--json", action="store_true")
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


def _import(args: argparse.Namespace) -> int:
    start = time.monotonic()
    if not args.json:
        print(f"importing {args.ref} ...", file=sys.stderr)
    image = default_store().import_image(args.ref, args.name)
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
