"""Image references: the one grammar of what a sandbox's root filesystem comes from.

Parsed here and nowhere else, into plain data (`ImageRef`), with nothing but the standard
library and karotte.errors: the spec imports it from the floor of the layers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import KarotteError

GRAMMAR = """\
  host                           the host's own userland (the default)
  dir:PATH                       a root filesystem tree (a sandbox runs on it as it is;
                                 `karotte image import` copies it in, hashed)
  oci:PATH[:TAG]                 an OCI image layout directory
  oci-archive:FILE[:TAG]         a tar of an OCI image layout
  docker-archive:FILE[:REPO:TAG] `docker save` / `podman save` output (either form)
  debian:SUITE[+PKG,PKG...]      built with mmdebstrap from Debian's archive
  NAME                           a name given at import (e.g. tb/chess)"""

KINDS = ("host", "dir", "oci", "oci-archive", "docker-archive", "debian", "name")

# A name given at import: lowercase path components, as a repository name reads.
_COMPONENT = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_MAX_COMPONENTS = 8
# org.opencontainers.image.ref.name (image-spec annotations.md), bounded.
_OCI_TAG = re.compile(r"[A-Za-z0-9]+(?:(?:[-._:@+]|--)[A-Za-z0-9]+)*(?:/[A-Za-z0-9]+"
                      r"(?:(?:[-._:@+]|--)[A-Za-z0-9]+)*)*")
# A Docker repository (an optional registry: localhost, a dotted host, or host:port; then
# lowercase path components) and a tag.
_REPO = re.compile(r"(?:(?:localhost|[A-Za-z0-9-]+\.[A-Za-z0-9.-]+)(?::[0-9]+)?/|"
                   r"[A-Za-z0-9-]+:[0-9]+/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
                   r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_DOCKER_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_SUITE = re.compile(r"[a-z][a-z0-9-]{0,63}")
_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]{0,127}")  # Debian policy 5.6.1
_MAX_TAG = 512


class ImageRefError(KarotteError, ValueError):
    """An image reference that does not parse. The message shows the text with a caret
    under what is wrong, and the grammar."""

    def __init__(self, text: str, at: int, what: str):
        self.text, self.at, self.what = text, at, what
        super().__init__(f"bad image reference {text!r}: {what}\n    {text}\n    {' ' * at}^\n"
                         f"an image reference is one of:\n{GRAMMAR}")


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference. Fields a kind does not use are None (packages: ()).

    kind: one of KINDS; path: dir, oci, oci-archive, docker-archive (as written);
    tag: oci and oci-archive (the ref.name annotation), docker-archive ("REPO:TAG");
    suite and packages: debian (packages sorted, without repeats); name: name.
    """

    kind: str
    path: str | None = None
    tag: str | None = None
    suite: str | None = None
    packages: tuple[str, ...] = ()
    name: str | None = None

    def __str__(self) -> str:
        if self.kind == "host":
            return "host"
        if self.kind == "name":
            return str(self.name)
        if self.kind == "debian":
            return f"debian:{self.suite}" + (f"+{','.join(self.packages)}" if self.packages else "")
        return f"{self.kind}:{self.path}" + (f":{self.tag}" if self.tag else "")


def parse(text: str) -> ImageRef:
    """Parse an image reference (see GRAMMAR); raises ImageRefError naming what is wrong."""
    if not isinstance(text, str):
        raise ImageRefError(repr(text), 0, f"an image reference is a str, not {type(text).__name__}")
    if text == "host":
        return ImageRef("host")
    kind, colon, rest = text.partition(":")
    if not colon:
        if text.startswith(("/", ".")):
            raise ImageRefError(text, 0, "a path needs its kind in front: dir:PATH, oci:PATH, "
                                "oci-archive:FILE or docker-archive:FILE")
        return ImageRef("name", name=parse_name(text, _whole=text))
    at = len(kind) + 1
    if kind == "dir":
        return ImageRef("dir", path=_path(text, at, rest, "PATH"))
    if kind in ("oci", "oci-archive"):
        # As skopeo does: the path ends at the first colon; the tag is the rest.
        path, colon, tag = rest.partition(":")
        _path(text, at, path, "PATH" if kind == "oci" else "FILE")
        if colon:
            _match(text, at + len(path) + 1, tag, _OCI_TAG, "TAG (an OCI ref.name: letters, "
                   "digits, and - . _ : @ + / between them)")
        return ImageRef(kind, path=path, tag=tag or None)
    if kind == "docker-archive":
        path, colon, tag = rest.partition(":")
        _path(text, at, path, "FILE")
        if colon:
            tag_at = at + len(path) + 1
            repo, colon, name_tag = tag.rpartition(":")
            if not colon or "/" in name_tag:
                raise ImageRefError(text, tag_at + len(tag), "REPO:TAG needs a tag after the "
                                    "repository, e.g. docker-archive:FILE:repo/x:latest")
            _match(text, tag_at, repo, _REPO, "REPO (a Docker repository: lowercase "
                   "components separated by /, after an optional host[:port]/)")
            _match(text, tag_at + len(repo) + 1, name_tag, _DOCKER_TAG, "TAG (letters, digits, "
                   "_ . -, at most 128, not starting with . or -)")
        return ImageRef(kind, path=path, tag=tag or None)
    if kind == "debian":
        suite, plus, packages = rest.partition("+")
        _match(text, at, suite, _SUITE, "SUITE (a Debian suite or codename, e.g. bookworm)")
        names: list[str] = []
        if plus:
            pos = at + len(suite) + 1
            for package in packages.split(","):
                _match(text, pos, package, _PACKAGE, "PKG (a Debian package name: lowercase "
                       "letters, digits, + - .; packages are separated by commas)")
                names.append(package)
                pos += len(package) + 1
        return ImageRef("debian", suite=suite, packages=tuple(sorted(set(names))))
    if kind in KINDS:
        raise ImageRefError(text, 0, f"{kind!r} takes no ':'")
    raise ImageRefError(text, 0, f"unknown kind {kind!r} (a name given at import has no ':')")


def parse_name(text: str, *, _whole: str | None = None) -> str:
    """Check a name given at import (`--name tb/chess`): lowercase components of letters,
    digits and . _ -, each starting with a letter or digit, separated by /; not "host"."""
    whole = text if _whole is None else _whole
    if not isinstance(text, str):
        raise ImageRefError(repr(text), 0, f"a name is a str, not {type(text).__name__}")
    if text == "host":
        raise ImageRefError(whole, 0, "'host' is the host's userland, not a name")
    what = ("NAME (lowercase letters, digits and . _ -, components separated by /, each "
            "starting with a letter or digit, no ':')")
    if not text:
        _match(whole, 0, text, _COMPONENT, what)
    components = text.split("/")
    if len(components) > _MAX_COMPONENTS:
        raise ImageRefError(whole, 0, f"more than {_MAX_COMPONENTS} components: expected {what}")
    at = 0
    for component in components:
        if not component:
            raise ImageRefError(whole, at, f"an empty component: expected {what}")
        _match(whole, at, component, _COMPONENT, what)
        at += len(component) + 1
    return text


def _path(text: str, at: int, path: str, what: str) -> str:
    if not path:
        raise ImageRefError(text, at, f"{what} is empty")
    if "\0" in path:
        raise ImageRefError(text, at + path.index("\0"), f"{what} holds a NUL byte")
    return path


def _match(text: str, at: int, part: str, pattern: re.Pattern[str], what: str) -> None:
    if not part:
        raise ImageRefError(text, at, f"{what.split(' (')[0]} is empty: expected {what}")
    if len(part) > _MAX_TAG:
        raise ImageRefError(text, at, f"longer than {_MAX_TAG} characters: expected {what}")
    m = pattern.match(part)
    if m is None or m.end() != len(part):
        bad = 0 if m is None else m.end()
        raise ImageRefError(text, at + bad, f"unexpected {part[bad]!r}: expected {what}")
