"""A tar stream read once, in order, as a hostile layer is read: headers parsed in
Python without tarfile's per-read copies (its stream mode re-joins its buffer on every
read: a third of an import's time), and each member's data handed out as views of the
chunks read, so a file is hashed and written without a copy.

What it reads: ustar, GNU and pax headers, as tarfile does (a checksum signed or not;
octal or base-256 numbers; a `prefix`; GNU long names and link names; pax `path`,
`linkpath`, `size`, `mtime`, `uid`, `gid`, global pax headers applying to every later
member). Names stay bytes, exactly as the tar has them. What it refuses, as TarError
(which extract turns into IMG-TAR-01): a header whose checksum does not match (tarfile
would take it for the end of the archive and silently drop the rest), a partial header,
a number that does not parse, a negative size, an extended header (pax, GNU long name)
over EXTENDED_HEADER_LIMIT or more than _EXTENDED_RUN of them in a row, any sparse file,
and data that ends before its header's size. A zero block or the end of the stream after
a member ends the archive.
"""
from __future__ import annotations

import re
from typing import Any, Iterator

# Bytes of one pax or GNU long-name header, read whole into memory. A path is at most
# max_path_bytes; the rest (xattrs) is dropped anyway.
EXTENDED_HEADER_LIMIT = 64 << 10
_EXTENDED_RUN = 16  # extended headers before one member, at most
_BLOCK = 512
_ZERO = bytes(_BLOCK)
_LOW = bytes(range(128))
_READ = 1 << 20

REGULAR = (b"0", b"\0", b"7")  # tarfile's regular types (7: contiguous); S: sparse, refused
DIRECTORY, SYMLINK, HARDLINK = b"5", b"2", b"1"
CHARDEV, BLOCKDEV, FIFO = b"3", b"4", b"6"
_PAX, _PAX_GLOBAL, _PAX_SOLARIS = b"x", b"g", b"X"
_LONGNAME, _LONGLINK, _SPARSE = b"L", b"K", b"S"
_EXTENDED = (_PAX, _PAX_GLOBAL, _PAX_SOLARIS, _LONGNAME, _LONGLINK)
_PAX_RECORD = re.compile(rb"(\d+) ([^=\n]+)=")


class TarError(Exception):
    """The stream is not a well-formed tar (the message says where)."""


class Member:
    """One member's header, with its extended headers applied."""

    __slots__ = ("name", "linkname", "type", "mode", "uid", "gid", "size", "mtime")

    def __init__(self, name: bytes, linkname: bytes, type_: bytes, mode: int, uid: int,
                 gid: int, size: int, mtime: float):
        self.name, self.linkname, self.type = name, linkname, type_
        self.mode, self.uid, self.gid, self.size, self.mtime = mode, uid, gid, size, mtime

    def isreg(self) -> bool:
        return self.type in REGULAR


def _number(field: bytes) -> int:
    if field[0] in (0o200, 0o377):  # base-256, as GNU tar writes large values
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0o377 else n
    text = field.split(b"\0", 1)[0].strip()
    if text.translate(None, b"01234567"):  # int() would take a sign, "0o" or "_"
        raise TarError(f"a number field {bytes(field)!r} that is not octal")
    return int(text or b"0", 8)


def _text(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


def _checksum_ok(block: bytes) -> bool:
    want = _number(block[148:156])
    unsigned = sum(block) - sum(block[148:156]) + 256  # the field counts as 8 spaces
    if want == unsigned:
        return True
    high = len(block[:148].translate(None, _LOW)) + len(block[156:].translate(None, _LOW))
    return want == unsigned - 256 * high  # the signed sum some old tars wrote


def _pax(data: bytes) -> dict[bytes, bytes]:
    records: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data) and data[pos:pos + 1] != b"\0":
        match = _PAX_RECORD.match(data, pos)
        length = int(match.group(1)) if match else 0
        if not match or length <= match.end() - pos or data[pos + length - 1:pos + length] != b"\n":
            raise TarError("a malformed pax header record")
        records[match.group(2)] = data[match.end():pos + length - 1]
        pos += length
    return records


class TarReader:
    """Members of the tar that stream reads, in order: next() is the next member (None
    at the end), data(n) its data in views of what was read."""

    def __init__(self, stream: Any):
        self._stream = stream
        self._chunk = memoryview(b"")
        self._at = 0
        self._left = 0  # bytes of the current member's data (and padding) not yet read
        self._global: dict[bytes, bytes] = {}
        self.started = False  # a first header was read

    def _fill(self, want: int = 0) -> bool:
        """More of the stream after what is left of the chunk (want bytes of it in all, if
        the stream has them; 0: any more), in a new buffer (never written again once
        filled: views of it are handed out and hashed by other threads): the stream's
        next chunk read ahead where it has take(), else read into one here."""
        rest = self._chunk[self._at:]
        take = getattr(self._stream, "take", None)  # a stream read ahead (blobs.Tee)
        if take is not None:
            chunk = take(rest, want)
            if chunk is None:
                return False
            self._chunk, self._at = chunk, 0
            return True
        buf = bytearray(len(rest) + _READ)
        buf[:len(rest)] = rest
        with memoryview(buf) as view:
            n = self._stream.readinto(view[len(rest):])
        if not n:
            return False
        self._chunk = memoryview(buf)[:len(rest) + n].toreadonly()
        self._at = 0
        return True

    def _take(self, n: int) -> bytes:
        """n bytes (fewer at the end of the stream)."""
        while len(self._chunk) - self._at < n:
            if not self._fill(n):
                break
        out = self._chunk[self._at:self._at + n]
        self._at += len(out)
        return bytes(out)

    def _skip(self, n: int) -> None:
        while n:
            have = len(self._chunk) - self._at
            if not have and not self._fill():
                raise TarError("the stream ends inside a member's data")
            step = min(n, len(self._chunk) - self._at)
            self._at += step
            n -= step

    def data(self, size: int) -> Iterator[memoryview]:
        """The current member's data, size bytes (its header's), in views valid until the
        next call; TarError if the stream ends first."""
        size = min(size, self._left)
        while size:
            if self._at == len(self._chunk) and not self._fill():
                raise TarError(f"the stream ends with {size} bytes of data still to come")
            view = self._chunk[self._at:self._at + size]
            self._at += len(view)
            self._left -= len(view)
            size -= len(view)
            yield view

    def pending(self) -> memoryview:
        """What is read and not yet taken, past the current member's data: for a caller
        that applies whole members from it itself (and says how much with consume), where
        no global pax header applies (plain() is then True)."""
        self._skip(self._left)
        self._left = 0
        return self._chunk[self._at:]

    def more(self, n: int) -> bool:
        """Whether n bytes past the current member's data are read (read on for them, to
        the end of the stream at most)."""
        self._skip(self._left)
        self._left = 0
        while len(self._chunk) - self._at < n:
            if not self._fill(n):
                return False
        return True

    def plain(self) -> bool:
        return not self._global

    def consume(self, n: int) -> None:
        if n:
            self._at += n
            self.started = True

    def next(self) -> Member | None:
        self._skip(self._left)
        self._left = 0
        local: dict[bytes, bytes] = {}
        long_name = long_link = None
        for _ in range(_EXTENDED_RUN + 1):
            block = self._take(_BLOCK)
            if not block or block == _ZERO:
                if not block and not self.started:
                    raise TarError("an empty stream")
                return None
            if len(block) != _BLOCK:
                raise TarError("a truncated header")
            if not _checksum_ok(block):
                raise TarError("bad checksum at a header")
            self.started = True
            kind = block[156:157]
            size = _number(block[124:136])
            if size < 0:
                raise TarError(f"a negative size {size}")
            if kind == _SPARSE:  # its maps run on for any number of blocks
                raise TarError("a GNU sparse file (not supported in layers)")
            if kind not in _EXTENDED:
                return self._member(block, kind, size, {**self._global, **local},
                                    long_name, long_link)
            if size > EXTENDED_HEADER_LIMIT:
                raise TarError(f"an extended header of {size} bytes (at most "
                               f"{EXTENDED_HEADER_LIMIT})")
            data = self._take(size)
            self._skip(-size % _BLOCK)
            if len(data) != size:
                raise TarError("the stream ends inside an extended header")
            if kind == _LONGNAME:
                long_name = _text(data)
            elif kind == _LONGLINK:
                long_link = _text(data)
            else:
                (self._global if kind == _PAX_GLOBAL else local).update(_pax(data))
        raise TarError(f"more than {_EXTENDED_RUN} extended headers before a member")

    def _member(self, block: bytes, kind: bytes, size: int, pax: dict[bytes, bytes],
                long_name: bytes | None, long_link: bytes | None) -> Member:
        name = _text(block[0:100])
        if kind == b"\0" and name.endswith(b"/"):
            kind = DIRECTORY
        prefix = _text(block[345:500])
        if prefix:
            name = prefix + b"/" + name
        if long_name is not None:
            name = long_name
        link = long_link if long_link is not None else _text(block[157:257])
        # The permission bits only: a base-256 mode field can hold any number.
        mode, uid, gid = (_number(block[100:108]) & 0o7777, _number(block[108:116]),
                          _number(block[116:124]))
        mtime: float = _number(block[136:148])
        if any(key.startswith(b"GNU.sparse.") for key in pax):
            raise TarError("a pax sparse file (not supported in layers)")
        try:
            name = pax.get(b"path", name)
            link = pax.get(b"linkpath", link)
            size = int(pax[b"size"]) if b"size" in pax else size
            uid = int(pax[b"uid"]) if b"uid" in pax else uid
            gid = int(pax[b"gid"]) if b"gid" in pax else gid
            mtime = float(pax[b"mtime"]) if b"mtime" in pax else mtime
        except ValueError as exc:
            raise TarError(f"a pax number that does not parse ({exc})") from None
        if size < 0:
            raise TarError(f"a negative size {size}")
        if kind in REGULAR:  # only these have data after the header (as tarfile reads it)
            self._left = size + (-size % _BLOCK)
        return Member(name, link, kind, mode, uid, gid, size, mtime)
