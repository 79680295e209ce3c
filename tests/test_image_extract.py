"""karotte.images.extract: one OCI layer applied onto a tree, every layer hostile.

Hostile layers are made here with tarfile, one test per attack (named after its id);
the realistic test applies the layers of an image umoci made and compares the tree with
umoci's own unpack of it. Every test checks that nothing outside the tree changed: a
sentinel directory lies next to the root.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from karotte.images import fastpath
from karotte.images import extract as extract_module
from karotte.images import tree as tree_module
from karotte.images.extract import (EXTENDED_HEADER_LIMIT, RULES, LayerBudget, LayerError,
                                    TreeEntry, apply_layer, image_ids, manifest)
from karotte.images.tree import manifest_text
from karotte.images.tarstream import TarReader
from karotte.scan import escape

SECRET = b"the host's own file\n"


# -- layers made with tarfile

def reg(name: str, data: bytes = b"", mode: int = 0o644, **attrs) -> tuple:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, data


def folder(name: str, mode: int = 0o755, **attrs) -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, None


def sym(name: str, target: str) -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
    return info, None


def hard(name: str, target: str) -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.LNKTYPE, target
    return info, None


def node(name: str, kind: bytes) -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor = kind, 1, 3
    return info, None


def layer(*members: tuple, fmt: int = tarfile.PAX_FORMAT) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, None if data is None else io.BytesIO(data))
    buf.seek(0)
    return buf


class Tree:
    """A root directory to apply layers onto, and a sentinel directory next to it."""

    def __init__(self, base: Path):
        self.base = base
        self.path = base / "root"
        self.outside = base / "outside"
        self.path.mkdir()
        self.outside.mkdir()
        (self.outside / "secret").write_bytes(SECRET)
        (self.outside / "x").write_bytes(SECRET)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)

    def apply(self, *members: tuple, budget: LayerBudget = LayerBudget(), ids=None) -> None:
        apply_layer(layer(*members), self.fd, budget=budget, ids=ids)

    def refused(self, rule: str, *members: tuple, budget: LayerBudget = LayerBudget(),
                ids=None) -> LayerError:
        with pytest.raises(LayerError) as info:
            self.apply(*members, budget=budget, ids=ids)
        assert info.value.rule == rule, str(info.value)
        return info.value

    def untouched(self) -> None:
        assert sorted(os.listdir(self.base)) == ["outside", "root"]
        assert sorted(os.listdir(self.outside)) == ["secret", "x"]
        assert (self.outside / "secret").read_bytes() == SECRET
        assert (self.outside / "x").read_bytes() == SECRET

    def listing(self) -> list[str]:
        return [e.path for e in manifest(self.fd)]


@pytest.fixture
def tree(tmp_path):
    t = Tree(tmp_path)
    yield t
    t.untouched()
    os.close(t.fd)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to other owners, "
                                "and to drop to an unprivileged user)")


# -- IMG-TRAVERSAL-01

@pytest.mark.parametrize("name", ["../outside/secret", "a/../../outside/secret",
                                  "./../outside/secret", "/outside/secret", "//abs"])
def test_IMG_TRAVERSAL_01_names_that_leave_the_root_are_refused(tree, name):
    err = tree.refused("IMG-TRAVERSAL-01", folder("a"), reg(name, b"pwned"))
    assert err.entry == name
    assert name in str(err) and "IMG-TRAVERSAL-01" in str(err) and "image is refused" in str(err)


def test_IMG_TRAVERSAL_01_a_file_where_a_directory_is_needed_is_refused(tree):
    tree.refused("IMG-TRAVERSAL-01", reg("f", b"x"), reg("f/g", b"y"))


def test_IMG_TRAVERSAL_01_a_root_entry_that_is_not_a_directory_is_refused(tree):
    tree.refused("IMG-TRAVERSAL-01", sym(".", str(tree.outside)))


# -- IMG-SYMLINK-01

def test_IMG_SYMLINK_01_write_through_a_symlink_planted_by_an_earlier_entry(tree):
    err = tree.refused("IMG-SYMLINK-01", sym("l", str(tree.outside)), reg("l/secret", b"pwned"))
    assert err.entry == "l/secret"


def test_IMG_SYMLINK_01_write_through_a_relative_symlink_deeper_down(tree):
    tree.refused("IMG-SYMLINK-01", folder("a"), sym("a/up", "../../outside"),
                 folder("a/up/new"))


def test_IMG_SYMLINK_01_write_through_a_symlink_planted_by_an_earlier_layer(tree):
    tree.apply(folder("etc"), sym("etc/l", str(tree.outside)))
    tree.refused("IMG-SYMLINK-01", reg("etc/l/x", b"pwned"))
    tree.refused("IMG-SYMLINK-01", sym("etc/l/new", "/"))


def test_IMG_SYMLINK_01_an_entry_over_a_planted_symlink_replaces_the_link(tree):
    tree.apply(sym("secret", str(tree.outside / "secret")), sym("d", str(tree.outside)))
    tree.apply(reg("secret", b"mine"), folder("d"), reg("d/x", b"mine"))
    assert (tree.path / "secret").read_bytes() == b"mine"
    assert not (tree.path / "secret").is_symlink()
    assert (tree.path / "d").is_dir() and not (tree.path / "d").is_symlink()
    assert (tree.path / "d" / "x").read_bytes() == b"mine"


def test_IMG_SYMLINK_01_absolute_symlink_targets_are_kept_and_never_followed(tree):
    tree.apply(folder("etc"), sym("etc/localtime", "/usr/share/zoneinfo/UTC"),
               sym("etc/host", str(tree.outside)))
    assert os.readlink(tree.path / "etc/localtime") == "/usr/share/zoneinfo/UTC"
    entries = {e.path: e for e in manifest(tree.fd)}
    assert entries["etc/localtime"] == TreeEntry("etc/localtime", "symlink", 0o777, 0, 0, 23,
                                                 None, "/usr/share/zoneinfo/UTC")
    tree.refused("IMG-SYMLINK-01", reg("etc/host/secret", b"pwned"))


# -- IMG-HARDLINK-01

@pytest.mark.parametrize("target", ["../outside/secret", "/etc/passwd", "a/../../outside/x"])
def test_IMG_HARDLINK_01_links_outside_the_tree_are_refused(tree, target):
    tree.refused("IMG-HARDLINK-01", folder("a"), hard("a/l", target))
    assert os.stat(tree.outside / "secret").st_nlink == 1


def test_IMG_HARDLINK_01_a_link_through_a_planted_symlink_is_refused(tree):
    tree.refused("IMG-HARDLINK-01", sym("l", str(tree.outside)), hard("pwn", "l/secret"))
    assert os.stat(tree.outside / "secret").st_nlink == 1


def test_IMG_HARDLINK_01_a_link_to_a_name_not_yet_extracted_is_refused(tree):
    tree.refused("IMG-HARDLINK-01", hard("early", "late"), reg("late", b"x"))


def test_IMG_HARDLINK_01_a_link_to_a_directory_or_a_symlink_is_refused(tree):
    tree.refused("IMG-HARDLINK-01", folder("d"), hard("l", "d"))
    tree.refused("IMG-HARDLINK-01", sym("s", str(tree.outside / "secret")), hard("l", "s"))
    assert not (tree.path / "l").exists()


def test_IMG_HARDLINK_01_a_link_to_a_file_of_this_or_a_lower_layer_shares_its_inode(tree):
    tree.apply(reg("low", b"lower"))
    tree.apply(reg("f", b"data"), hard("g", "f"), hard("h", "./low"))
    assert os.stat(tree.path / "g").st_ino == os.stat(tree.path / "f").st_ino
    assert os.stat(tree.path / "h").st_ino == os.stat(tree.path / "low").st_ino


# -- IMG-DEVICE-01

@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE, b"Z"])
def test_IMG_DEVICE_01_devices_fifos_and_unknown_types_are_refused(tree, kind):
    err = tree.refused("IMG-DEVICE-01", folder("dev"), node("dev/null", kind))
    assert err.entry == "dev/null"
    assert not (tree.path / "dev" / "null").exists()


# -- IMG-SETUID-01

def test_IMG_SETUID_01_setuid_setgid_and_sticky_bits_are_stripped_not_refused(tree):
    tree.apply(folder("bin"), reg("bin/su", b"x", 0o4755), reg("bin/sg", b"x", 0o2711),
               reg("bin/st", b"x", 0o1644), folder("tmp", 0o1777), folder("g", 0o2775),
               reg("ww", b"x", 0o666))
    modes = {e.path: e.mode for e in manifest(tree.fd)}
    assert modes["bin/su"] == 0o755 and modes["bin/sg"] == 0o711 and modes["bin/st"] == 0o644
    assert modes["tmp"] == 0o1777  # a directory keeps its sticky bit
    assert modes["g"] == 0o775
    assert modes["ww"] == 0o666  # world-writable stays as the image says


# -- IMG-XATTR-01

def test_IMG_XATTR_01_no_xattr_of_the_layer_is_set(tree):
    xattrs = {"SCHILY.xattr.security.capability": "\x01\x00\x00\x02",
              "SCHILY.xattr.trusted.overlay.opaque": "y",
              "SCHILY.xattr.user.overlay.redirect": "/etc",
              "SCHILY.xattr.user.note": "hello"}
    tree.apply(reg("f", b"x", pax_headers=xattrs), folder("d", pax_headers=xattrs))
    for name in ("f", "d"):
        assert os.listxattr(tree.path / name, follow_symlinks=False) == []


# -- IMG-WHITEOUT-01

def test_IMG_WHITEOUT_01_a_whiteout_deletes_the_lower_name_without_following_links(tree):
    tree.apply(folder("etc"), reg("etc/gone", b"x"), folder("etc/dir"), reg("etc/dir/f", b"y"),
               sym("etc/dir/out", str(tree.outside)), sym("etc/link", str(tree.outside)),
               reg("etc/kept", b"z"))
    tree.apply(reg("etc/.wh.gone"), reg("etc/.wh.dir"), reg("etc/.wh.link"),
               reg("etc/.wh.never-there"), reg("nowhere/.wh.x"))
    assert tree.listing() == [".", "etc", "etc/kept"]


@pytest.mark.parametrize("marker_first", [True, False])
def test_IMG_WHITEOUT_01_an_opaque_directory_keeps_only_this_layers_entries(tree, marker_first):
    tree.apply(folder("o"), reg("o/a", b"lower"), folder("o/sub"), reg("o/sub/b", b"lower"),
               reg("o/c", b"lower"))
    marker = reg("o/.wh..wh..opq")
    mine = [reg("o/c", b"upper"), folder("o/sub"), reg("o/sub/new", b"upper")]
    tree.apply(*([marker, *mine] if marker_first else [*mine, marker]))
    assert tree.listing() == [".", "o", "o/c", "o/sub", "o/sub/new"]
    assert (tree.path / "o/c").read_bytes() == b"upper"


@pytest.mark.parametrize("whiteout_first", [True, False])
def test_IMG_WHITEOUT_01_a_whiteout_never_deletes_what_its_own_layer_adds(tree, whiteout_first):
    tree.apply(reg("f", b"lower"), folder("d"), reg("d/lower", b"lower"))
    whiteouts = [reg(".wh.f"), reg(".wh.d")]
    mine = [reg("f", b"upper"), reg("d/upper", b"upper")]
    tree.apply(*(whiteouts + mine if whiteout_first else mine + whiteouts))
    assert tree.listing() == [".", "d", "d/upper", "f"]
    assert (tree.path / "f").read_bytes() == b"upper"


@pytest.mark.parametrize("name", [".wh.", ".wh..", ".wh...", "d/.wh..", "d/.wh...",
                                  ".wh..wh..opq"])
def test_IMG_WHITEOUT_01_whiteouts_of_the_parent_or_the_root_are_refused(tree, name):
    tree.apply(folder("d"), reg("d/f", b"x"))
    tree.refused("IMG-WHITEOUT-01", reg(name))
    assert tree.listing() == [".", "d", "d/f"]


def test_IMG_WHITEOUT_01_a_whiteout_through_a_planted_symlink_is_refused(tree):
    tree.apply(sym("l", str(tree.outside)))
    tree.refused("IMG-SYMLINK-01", reg("l/.wh.secret"))
    tree.refused("IMG-SYMLINK-01", reg("l/.wh..wh..opq"))


@pytest.mark.parametrize("member", [folder(".wh.x"), sym(".wh.x", "/"), reg(".wh.x", b"data"),
                                    reg(".wh.d/f", b"x"), reg("d/.wh..wh.x")])
def test_IMG_WHITEOUT_01_malformed_whiteouts_are_refused(tree, member):
    tree.apply(reg("x", b"x"))
    tree.refused("IMG-WHITEOUT-01", member)
    assert tree.listing() == [".", "x"]


def test_IMG_WHITEOUT_01_aufs_metadata_is_skipped_and_links_into_it_refused(tree):
    tree.apply(folder(".wh..wh.plnk"), reg(".wh..wh.plnk/1234.5678", b"x"),
               folder(".wh..wh.orph"), reg(".wh..wh.aufs"), reg("f", b"x"))
    assert tree.listing() == [".", "f"]
    tree.refused("IMG-HARDLINK-01", reg(".wh..wh.plnk/1.2", b"x"), hard("l", ".wh..wh.plnk/1.2"))


# -- IMG-BOMB-01

def test_IMG_BOMB_01_a_size_is_checked_from_the_header_before_its_data_is_read(tree):
    info, _ = reg("big")
    info.size = 1 << 30  # the stream holds a few bytes: the header lies, and is over budget
    stream = layer((info, None))
    with pytest.raises(LayerError) as err:
        apply_layer(stream, tree.fd, budget=LayerBudget(max_file_size=1 << 20))
    assert err.value.rule == "IMG-BOMB-01"
    assert not (tree.path / "big").exists()


def test_IMG_BOMB_01_the_trees_bytes_after_the_layer_are_bounded(tree):
    budget = LayerBudget(max_bytes=1000)
    tree.apply(reg("a", b"x" * 600), hard("a2", "a"), budget=budget)  # a link costs nothing
    tree.refused("IMG-BOMB-01", reg("b", b"y" * 600), budget=budget)
    tree.apply(reg(".wh.a"), reg(".wh.a2"), reg("b", b"y" * 600), budget=budget)  # freed
    tree.apply(reg("b", b"z" * 900), budget=budget)  # a replaced file frees its bytes
    tree.refused("IMG-BOMB-01", reg("c", b"w" * 101), budget=budget)


@pytest.mark.parametrize("budget, members", [
    (LayerBudget(max_entries=3), [reg(f"f{i}") for i in range(4)]),
    (LayerBudget(max_depth=3), [reg("a/b/c/d")]),
    (LayerBudget(max_path_bytes=64), [reg("n" * 65)]),
    (LayerBudget(max_path_bytes=64), [sym("s", "t" * 65)]),
    (LayerBudget(max_path_bytes=64), [reg("f"), hard("l", "./" + "/" * 63 + "f")]),
    (LayerBudget(max_bytes=100), [reg(".wh..wh.plnk/1.1", b"x" * 101)]),  # skipped, still read
])
def test_IMG_BOMB_01_counts_depths_and_lengths_within_the_budget(tree, budget, members):
    tree.refused("IMG-BOMB-01", *members, budget=budget)


def test_IMG_BOMB_01_an_oversized_extended_header_is_refused_before_it_is_read(tree):
    big = {"SCHILY.xattr.user.pad": "p" * (EXTENDED_HEADER_LIMIT + 1)}
    tree.refused("IMG-TAR-01", reg("f", b"x", pax_headers=big))
    assert not (tree.path / "f").exists()


# -- IMG-TAR-01

def test_IMG_TAR_01_a_truncated_layer_is_refused(tree):
    data = layer(reg("f", b"x" * 5000)).getvalue()
    with pytest.raises(LayerError) as err:
        apply_layer(io.BytesIO(data[:2048]), tree.fd)
    assert err.value.rule == "IMG-TAR-01" and err.value.entry == "f"


def test_IMG_TAR_01_a_corrupt_header_mid_stream_is_refused_not_taken_for_the_end(tree):
    data = bytearray(layer(reg("a", b"x"), reg("b", b"y"), fmt=tarfile.USTAR_FORMAT).getvalue())
    data[1024 + 10] ^= 0xFF  # the name of b's header: its checksum no longer matches
    with pytest.raises(LayerError) as err:
        apply_layer(io.BytesIO(bytes(data)), tree.fd)
    assert err.value.rule == "IMG-TAR-01" and err.value.entry == "a"


def test_IMG_TAR_01_random_mutations_raise_only_layer_errors_and_stay_inside(tmp_path):
    members = [folder("etc"), reg("etc/passwd", b"root:x:0:0\n" * 20, 0o4755),
               sym("etc/localtime", "/usr/share/zoneinfo/UTC"), hard("etc/hl", "etc/passwd"),
               folder("usr/lib", pax_headers={"SCHILY.xattr.user.a": "b"}),
               reg("usr/lib/.wh.gone"), reg("usr/.wh..wh..opq"), sym("up", "../outside"),
               reg("long/" + "n" * 150, b"z" * 700)]
    good = layer(*members).getvalue()
    with tarfile.open(fileobj=io.BytesIO(good)) as tar:
        headers = [m.offset for m in tar.getmembers()] + [m.offset_data - 512
                                                          for m in tar.getmembers()]
    rng = random.Random(9)
    for i in range(400):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            at = rng.choice(headers) + rng.randrange(512) if rng.random() < 0.8 else \
                rng.randrange(len(data))
            data[at] = rng.choice([0, 0x2F, 0x2E, 0x30, 0x31, 0x32, 0x33, 0x35, 0x36, 0x37,
                                   0xFF, rng.randrange(256)])
            if rng.random() < 0.7:  # a header with its checksum fixed gets past tarfile
                block = at - at % 512
                data[block + 148:block + 156] = b" " * 8
                data[block + 148:block + 156] = b"%06o\0 " % sum(data[block:block + 512])
        base = tmp_path / str(i)
        base.mkdir()
        t = Tree(base)
        try:
            budget = LayerBudget(max_bytes=1 << 20, max_file_size=1 << 20)
            apply_layer(io.BytesIO(bytes(data)), t.fd, budget=budget)
        except LayerError:
            pass
        finally:
            os.close(t.fd)
        t.untouched()
        shutil.rmtree(base)


def _fix_checksum(data: bytearray, block: int) -> None:
    data[block + 148:block + 156] = b" " * 8
    data[block + 148:block + 156] = b"%06o\0 " % sum(data[block:block + 512])


def test_IMG_TAR_01_a_base256_mode_keeps_its_permission_bits_only(tree):
    data = bytearray(layer(reg("f", b"x", 0o644), fmt=tarfile.USTAR_FORMAT).getvalue())
    data[100:108] = b"\x80" + ((1 << 50) | 0o4644).to_bytes(7, "big")  # any number fits
    _fix_checksum(data, 0)
    apply_layer(io.BytesIO(bytes(data)), tree.fd)
    assert [(e.path, e.mode) for e in manifest(tree.fd)][1:] == [("f", 0o644)]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT,
                                 tarfile.PAX_FORMAT])
def test_IMG_TAR_01_mutations_in_every_format_raise_only_layer_errors(tmp_path, fmt):
    # As the test above, with base-256 markers and the extended header types among the
    # bytes written, in each format the reader reads.
    members = [folder("etc"), reg("etc/passwd", b"root:x:0:0\n" * 20, 0o4755),
               sym("etc/localtime", "/usr/share/zoneinfo/UTC"), hard("etc/hl", "etc/passwd"),
               reg("usr/lib/.wh.gone"), reg("usr/.wh..wh..opq"), sym("up", "../outside")]
    if fmt != tarfile.USTAR_FORMAT:
        members.append(reg("long/" + "n" * 150, b"z" * 700))
    good = layer(*members, fmt=fmt).getvalue()
    with tarfile.open(fileobj=io.BytesIO(good)) as tar:
        headers = [m.offset for m in tar.getmembers()] + [m.offset_data - 512
                                                          for m in tar.getmembers()]
    rng = random.Random(fmt)
    for i in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            at = rng.choice(headers) + rng.randrange(512) if rng.random() < 0.8 else \
                rng.randrange(len(data))
            data[at] = rng.choice([0, 0x2F, 0x2E, 0x30, 0x31, 0x35, 0x37, 0x4C, 0x4B, 0x67,
                                   0x78, 0x80, 0xFF, rng.randrange(256)])
            if rng.random() < 0.7:
                _fix_checksum(data, at - at % 512)
        base = tmp_path / str(i)
        base.mkdir()
        t = Tree(base)
        try:
            apply_layer(io.BytesIO(bytes(data)), t.fd, hashes={},
                        budget=LayerBudget(max_bytes=1 << 20, max_file_size=1 << 20))
        except LayerError:
            pass
        finally:
            os.close(t.fd)
        t.untouched()
        subprocess.run(["chmod", "-R", "u+rwx", base], check=True)
        shutil.rmtree(base)


# -- what the tree holds, and how

@needs_root
def test_modes_owners_and_mtimes_come_from_the_tar(tree):
    tree.apply(folder("ro", 0o555, mtime=1_000_000, uid=7, gid=8),
               reg("ro/f", b"x", 0o640, mtime=2_000_000, uid=7, gid=8),
               sym("ro/s", "/nowhere", ), folder("priv", 0o700),
               ids=lambda uid, gid: (uid + 100_000, gid + 200_000))
    st = os.stat(tree.path / "ro")
    assert (stat.S_IMODE(st.st_mode), st.st_mtime, st.st_uid, st.st_gid) == \
        (0o555, 1_000_000, 100_007, 200_008)  # set after its entries were written
    st = os.stat(tree.path / "ro/f")
    assert (stat.S_IMODE(st.st_mode), st.st_mtime, st.st_uid, st.st_gid) == \
        (0o640, 2_000_000, 100_007, 200_008)
    st = os.lstat(tree.path / "ro/s")
    assert (st.st_uid, st.st_gid) == (100_000, 200_000)
    assert stat.S_IMODE(os.stat(tree.path / "priv").st_mode) == 0o700


def test_without_ids_everything_is_the_callers_own(tree):
    tree.apply(folder("d", uid=7, gid=8), reg("d/f", b"x", uid=7, gid=8), sym("d/s", "f"))
    assert {(e.uid, e.gid) for e in manifest(tree.fd)} == {(os.getuid(), os.getgid())}


def test_a_directory_over_a_directory_merges_and_other_entries_replace(tree):
    tree.apply(folder("d", 0o700), reg("d/lower", b"x"), folder("f"), reg("f/inner", b"x"),
               reg("g", b"x"))
    tree.apply(folder("d", 0o751), reg("f", b"file now"), folder("g"), reg("g/h", b"y"))
    entries = {e.path: e for e in manifest(tree.fd)}
    assert list(entries) == [".", "d", "d/lower", "f", "g", "g/h"]
    assert entries["d"].mode == 0o751 and entries["f"].type == "file"


def test_missing_parents_are_made_as_directories(tree):
    tree.apply(reg("a/b/c", b"x"))
    assert [(e.path, e.type, e.mode) for e in manifest(tree.fd)][1:] == [
        ("a", "dir", 0o755), ("a/b", "dir", 0o755), ("a/b/c", "file", 0o644)]


@needs_root
def test_unprivileged_a_read_only_directory_still_takes_its_entries(tmp_path):
    t = Tree(tmp_path)
    os.chown(t.path, 65534, 65534)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child drops to nobody and applies two layers
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            t.apply(folder(".", 0o555), folder("ro", 0o555), reg("ro/f", b"1"), folder("ro/sub", 0o500),
                    reg("ro/sub/g", b"2"), folder("shut", 0o000), reg("shut/s", b"4"))
            t.apply(reg("ro/h", b"3"), reg("ro/sub/.wh.g"))
            os.write(write, b"ok")
        except BaseException as exc:  # reported to the parent, which fails the test
            os.write(write, str(exc).encode())
        os._exit(0)
    os.close(write)
    report = os.read(read, 65536)
    os.close(read)
    os.waitpid(pid, 0)
    assert report.decode() == "ok"
    assert [(e.path, e.mode) for e in manifest(t.fd)] == [
        (".", 0o555), ("ro", 0o555), ("ro/f", 0o644), ("ro/h", 0o644), ("ro/sub", 0o500), ("shut", 0),
        ("shut/s", 0o644)]
    t.untouched()
    os.close(t.fd)


def test_manifest_lists_every_path_in_order_and_refuses_what_a_tree_cannot_hold(tree):
    tree.apply(folder("b"), reg("b/z", b"z"), reg("a", b"hello"), sym("c", "b/z"),
               reg("b/\xe9\\\n", b""))
    entries = manifest(tree.fd)
    assert [e.path for e in entries] == [".", "a", "b", "b/z", "b/\xe9\\x5c\\x0a", "c"]
    a = entries[1]
    assert a == TreeEntry("a", "file", 0o644, os.getuid(), os.getgid(), 5,
                          "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
                          None)
    os.mkfifo(tree.path / "b" / "fifo")
    with pytest.raises(LayerError) as err:
        manifest(tree.fd)
    assert err.value.rule == "IMG-TREE-01" and err.value.entry == "b/fifo"


@pytest.mark.skipif(not tree_module.NATIVE, reason="karotte._native is not built (pip install -e .)")
def test_the_c_walk_lists_the_manifest_the_python_walk_lists(tree):
    # Names in byte order (upper case, '-', a quote), symlinks absolute and relative,
    # empty directories, modes; hashes known for some files, one at a size it no longer
    # has (read again); the text in one C call; then names that need escaping (not
    # UTF-8, a backslash, a newline), and a FIFO, which stops both walks alike.
    tree.apply(folder("b", 0o750), reg("b/z", b"z"), reg("a", b"hello", 0o600),
               sym("c", "/etc/localtime"), folder("b/e"), reg("a-b", b"x" * 70_000),
               reg("B", b"upper"), sym("b/up", "../a"), folder("d/deeper/still"),
               reg("d/deeper/still/f", b"f"), reg('q"uote', b""))
    python = tree_module._manifest_python(tree.fd, {})
    assert tree_module.manifest(tree.fd, {}) == python
    assert [e.path for e in python][:4] == [".", "B", "a", "a-b"]
    files = {e.path: os.lstat(tree.path / e.path) for e in python if e.type == "file"}
    known = "ab" * 32
    hashes = {st.st_ino: (st.st_size, known) for path, st in files.items() if path != "a"}
    hashes[files["B"].st_ino] = (99, known)  # not its size now: hashed again
    native = tree_module.manifest(tree.fd, hashes)
    assert native == tree_module._manifest_python(tree.fd, hashes)
    digests = {e.path: e.sha256 for e in native if e.type == "file"}
    assert digests["b/z"] == digests["a-b"] == known
    assert digests["a"] == hashlib.sha256(b"hello").hexdigest()
    assert digests["B"] == hashlib.sha256(b"upper").hexdigest()
    size = 5 + 70_000 + 1 + 5 + 1
    assert tree_module.manifest_file(tree.fd, hashes) == (manifest_text(native), size)
    tree.apply(reg("b/\xe9\\\n", b""))
    os.mkdir(os.fsencode(tree.path) + b"/\xff")  # escaped: the text is Python's
    entries = tree_module._manifest_python(tree.fd, hashes)
    assert tree_module.manifest(tree.fd, hashes) == entries
    assert {"b/\xe9\\x5c\\x0a", "\\xff"} <= {e.path for e in entries}
    assert tree_module.manifest_file(tree.fd, hashes) == (manifest_text(entries), size)
    os.mkfifo(tree.path / "d" / "deeper" / "fifo")
    for walk in (tree_module.manifest, tree_module._manifest_python):
        with pytest.raises(LayerError) as err:
            walk(tree.fd, {})
        assert (err.value.rule, err.value.entry) == ("IMG-TREE-01", "d/deeper/fifo")
        assert "file type 0o10000" in err.value.detail


@pytest.mark.skipif(not tree_module.NATIVE, reason="karotte._native is not built (pip install -e .)")
def test_the_c_walk_of_a_deep_tree_with_long_targets_lists_what_the_python_walk_lists(tree):
    # 600 directories deep, a symlink of the longest target at every level: the C walk
    # keeps no per-level buffer on its stack.
    at = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=tree.fd)
    try:
        for i in range(600):
            os.symlink("t" * 4095, f"s{i}", dir_fd=at)
            os.mkdir("d", dir_fd=at)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=at)
            os.close(at)
            at = nxt
    finally:
        os.close(at)
    python = tree_module._manifest_python(tree.fd, {})
    assert len(python) == 1 + 2 * 600
    assert tree_module.manifest(tree.fd, {}) == python


def test_layer_error_names_entry_rule_and_detail_escaped():
    err = LayerError(escape(b"a\nb\xff"), "IMG-DEVICE-01", "a FIFO is not allowed")
    assert err.entry == "a\\x0ab\\xff"
    text = str(err)
    assert "a\\x0ab\\xff" in text and "IMG-DEVICE-01" in text and "a FIFO" in text
    assert "image is refused" in text
    assert set(RULES) >= {"IMG-TRAVERSAL-01", "IMG-SYMLINK-01", "IMG-HARDLINK-01",
                          "IMG-DEVICE-01", "IMG-WHITEOUT-01", "IMG-BOMB-01", "IMG-TAR-01"}


# -- a real image, made by umoci

def _umoci(*args: str, cwd: Path) -> None:
    subprocess.run(["umoci", *args], cwd=cwd, check=True, capture_output=True)


def _layers(layout: Path, tag: str) -> list[Path]:
    index = json.loads((layout / "index.json").read_text())
    digest = next(m["digest"] for m in index["manifests"]
                  if m["annotations"]["org.opencontainers.image.ref.name"] == tag)
    image = json.loads((layout / "blobs/sha256" / digest.split(":")[1]).read_text())
    return [layout / "blobs/sha256" / d["digest"].split(":")[1] for d in image["layers"]]


@pytest.mark.skipif(shutil.which("umoci") is None, reason="umoci is not installed")
def test_an_image_made_by_umoci_extracts_as_umoci_unpacks_it(tmp_path):
    _umoci("init", "--layout", "L", cwd=tmp_path)
    _umoci("new", "--image", "L:t", cwd=tmp_path)
    _umoci("unpack", "--rootless", "--image", "L:t", "B1", cwd=tmp_path)
    rootfs = tmp_path / "B1/rootfs"
    (rootfs / "etc/alternatives").mkdir(parents=True)
    (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (rootfs / "etc/gone").write_text("deleted by layer 2\n")
    (rootfs / "etc/alternatives/py").symlink_to("/usr/bin/python3.11")
    os.symlink("/usr/share/zoneinfo/UTC", rootfs / "etc/localtime")
    (rootfs / "usr/bin").mkdir(parents=True)
    (rootfs / "usr/bin/tool").write_bytes(os.urandom(70_000))
    (rootfs / "usr/bin/tool").chmod(0o755)
    os.link(rootfs / "usr/bin/tool", rootfs / "usr/bin/tool-again")
    (rootfs / "tmp").mkdir()
    (rootfs / "tmp").chmod(0o1777)
    (rootfs / "opt/deep/er").mkdir(parents=True)
    (rootfs / "opt/deep/er/f ü").write_text("x")
    (rootfs / "srv").mkdir(mode=0o700)
    _umoci("repack", "--image", "L:t", "B1", cwd=tmp_path)
    _umoci("unpack", "--rootless", "--image", "L:t", "B2", cwd=tmp_path)
    rootfs = tmp_path / "B2/rootfs"
    (rootfs / "etc/gone").unlink()
    shutil.rmtree(rootfs / "opt/deep")
    (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (rootfs / "srv/new").write_text("layer 2")
    (rootfs / "etc/alternatives/py").unlink()
    (rootfs / "etc/alternatives/py").mkdir()
    _umoci("repack", "--image", "L:t", "B2", cwd=tmp_path)

    blobs = _layers(tmp_path / "L", "t")
    assert len(blobs) == 2
    with gzip.open(blobs[1]) as f, tarfile.open(fileobj=f, mode="r|") as tar:
        names = [m.name for m in tar]
    assert "etc/.wh.gone" in names and "opt/.wh.deep" in names  # the real whiteout format

    ours = tmp_path / "ours"
    ours.mkdir()
    fd = os.open(ours, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for blob in blobs:
            with gzip.open(blob) as stream:
                apply_layer(stream, fd)
        got = manifest(fd)
    finally:
        os.close(fd)
    _umoci("raw", "unpack", "--rootless", "--image", "L:t", "theirs", cwd=tmp_path)
    fd = os.open(tmp_path / "theirs", os.O_RDONLY | os.O_DIRECTORY)
    try:
        want = manifest(fd)
    finally:
        os.close(fd)
    assert got == want
    paths = [e.path for e in got]
    assert "etc/gone" not in paths and "opt/deep" not in paths and "srv/new" in paths


# -- the tar reader (karotte/images/tarstream.py) against what real tools write

def _members_by_tarfile(data: bytes) -> list[tuple]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
        out = []
        for m in tar:
            body = tar.extractfile(m).read() if m.isreg() else b""
            out.append((os.fsencode(m.name), os.fsencode(m.linkname), m.type, m.mode, m.uid,
                        m.gid, m.size, int(m.mtime), body))
    return out


def _members_by_tarstream(data: bytes) -> list[tuple]:
    reader, out = TarReader(io.BytesIO(data)), []
    while (m := reader.next()) is not None:
        body = b"".join(reader.data(m.size)) if m.isreg() else b""
        out.append((m.name.rstrip(b"/"), m.linkname, m.type, m.mode, m.uid, m.gid, m.size,
                    int(m.mtime), body))
    return out


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT,
                                 tarfile.PAX_FORMAT])
def test_the_tar_reader_reads_what_tarfile_writes_in_each_format(fmt):
    deep = "d/" + "/".join(["seg" * 20] * 3)  # a prefix field in ustar, long names elsewhere
    members = [folder("d", 0o750, uid=3, gid=4, mtime=1_700_000_000), folder(deep),
               reg(deep + "/f", b"data" * 300, 0o640, uid=1000, gid=100),
               sym("d/link", "../" + "t" * (90 if fmt == tarfile.USTAR_FORMAT else 180)),
               reg("d/empty"), hard("d/hl", "d/empty")]
    if fmt != tarfile.USTAR_FORMAT:
        members += [hard("d/hl2", deep + "/f"), reg("n" * 150, b"long name"),
                    reg("big-ids", b"x", uid=3_000_000, gid=2_500_000),
                    reg("\xe9t\xe9", b"utf-8 name")]
    data = layer(*members, fmt=fmt).getvalue()
    assert _members_by_tarstream(data) == _members_by_tarfile(data)


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar"])
def test_the_tar_reader_reads_what_gnu_tar_writes(tmp_path, fmt):
    src = tmp_path / "src"
    deep = src / "a" / ("b" * 60) / ("c" * 60)
    deep.mkdir(parents=True)
    (deep / "file").write_bytes(os.urandom(3000))
    (src / "a" / "x").write_text("x")
    os.link(src / "a" / "x", src / "a" / "y")
    (src / "a" / "to").symlink_to("/usr/share/zoneinfo/UTC")
    out = subprocess.run(["tar", "-c", f"--format={fmt}", "-C", str(src), "."],
                         capture_output=True, check=True).stdout
    assert _members_by_tarstream(out) == _members_by_tarfile(out)


def test_the_tar_reader_applies_global_pax_headers_to_later_members():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT,
                      pax_headers={"uid": "77", "mtime": "1234.5"}) as tar:
        for name in ("f", "g"):
            tar.addfile(tarfile.TarInfo(name), io.BytesIO(b""))
    data = buf.getvalue()
    assert [(m[0], m[4], m[7]) for m in _members_by_tarstream(data)] == \
        [(m[0], m[4], m[7]) for m in _members_by_tarfile(data)] == [(b"f", 77, 1234),
                                                                    (b"g", 77, 1234)]


# -- the C fast path (csrc/extract.c) against extract.py's own steps

needs_native = pytest.mark.skipif(not fastpath.AVAILABLE,
                                  reason="karotte._native is not built (pip install -e .)")


def _outcome(data: bytes, base: Path, native: bool, ids=None, then: bytes | None = None,
             budget: LayerBudget = LayerBudget(max_bytes=1 << 20, max_file_size=1 << 20)
             ) -> tuple:
    """What applying data as two layers (the second `then`, or the first again: every
    name there) gives: the rule refused, or the tree's manifest, mtimes and bytes of files
    (as apply_layer counts them) after each."""
    base.mkdir()
    t = Tree(base)
    hashes: dict = {}
    try:
        total, seen = 0, []
        for each in (data, data if then is None else then):
            total = apply_layer(io.BytesIO(each), t.fd, hashes=hashes, tree_bytes=total,
                                native=native, ids=ids, budget=budget)
            seen.append((manifest(t.fd, hashes), manifest(t.fd), _mtimes(t.path), total))
        return ("tree", *seen[-1], seen[0])
    except LayerError as exc:
        return ("refused", exc.rule)
    finally:
        os.close(t.fd)
        t.untouched()


def _mtimes(root: Path) -> list[tuple[str, int | str]]:
    """Every path's mtime, which the manifest does not hold; a parent the tar never named
    has the time it was made ("now"), since the tars here give only small mtimes."""
    return sorted((str(p.relative_to(root)), m if (m := p.lstat().st_mtime_ns) < 10**17
                   else "now") for p in root.rglob("*"))


def _old_dir(name: str) -> tuple:
    """A directory as old tars write one: type NUL ('\\0', AREGTYPE) and a trailing slash."""
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.AREGTYPE, 0o751, 4_000
    return info, b""


def _nested_entries() -> list[tuple]:
    """Directories in directories, left for a parent's sibling and for the root again, a
    directory named once its children are there, and a whiteout of something this layer
    made: what the C run follows in its chain of directories, and where it must stop."""
    return [folder("n", 0o755, mtime=2_000), folder("n/a", 0o700, mtime=2_001),
            reg("n/a/f", b"f", mtime=2_002), folder("n/a/b", 0o750, mtime=2_003),
            reg("n/a/b/g", b"g"), sym("n/a/b/s", "../f"), reg("n/a/h", b"h"),
            folder("n/c", 0o1777, mtime=2_004), reg("n/c/i", b"i"), reg("top", b"t"),
            folder("n/a/b/deep", 0o705), reg("n/a/b/deep/j", b"j"), _old_dir("n/old/"),
            reg("n/old/k", b"k"), folder("n/a", 0o711, mtime=2_005), reg("n/.wh.c"),
            folder("n/c/again", 0o700)]


def _many_entries() -> list[tuple]:
    members = []
    for d in range(6):
        members.append(folder(f"d{d}", 0o755 - d))
        for f in range(30):
            members.append(reg(f"d{d}/f{f}", os.urandom(f * 37), 0o600 + f, mtime=1_000 + f))
        members += [sym(f"d{d}/s", "f1"), sym(f"d{d}/abs", "/etc/passwd"),
                    reg(f"d{d}/sub/deeper", b"y"), reg(f"./d{d}/dot", b"z"),
                    reg(f"d{d}/f3", b"again: replaced")]
    return members + _nested_entries()


@needs_native
@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT,
                                 tarfile.PAX_FORMAT])
def test_the_c_fast_path_makes_the_tree_extract_py_makes(tmp_path, fmt):
    data = layer(*_many_entries(), fmt=fmt).getvalue()
    fast = _outcome(data, tmp_path / "fast", True)
    assert fast[0] == "tree" and fast == _outcome(data, tmp_path / "slow", False)
    assert fast[1] == fast[2]  # the hashes taken from extraction are the files' own


@needs_native
def test_the_c_fast_path_reads_on_for_an_entry_across_reads_and_replaces_what_is_there(
        tmp_path, monkeypatch):
    # Files across the reader's 1 MiB reads (the C run reads on for up to GROW bytes), one
    # over GROW (left to extract.py), then the same layer again: each file and symlink
    # replaced where it is (the old one unlinked first, its bytes freed), a file where a
    # directory was (extract.py removes the directory), a directory where a file was.
    rng = random.Random(5)
    members = [folder("big")]
    for i in range(40):
        members.append(reg(f"big/f{i}", rng.randbytes(rng.choice([3_000, 90_000, 300_000]))))
    members += [reg("big/huge", rng.randbytes(fastpath.GROW + 1)), sym("big/s", "f1"),
                reg("big/hard", b"h"), hard("big/hard2", "big/hard"), folder("big/dir"),
                reg("big/dir/x", b"x")]
    data = layer(*members).getvalue()
    then = layer(*members[1:21], folder("big/f20"), reg("big/f20/x", b"x"), *members[22:-2],
                 reg("big/dir", b"a file now"), reg("big/hard", b"replaced")).getvalue()
    budget = LayerBudget(max_bytes=64 << 20, max_file_size=16 << 20)
    by_python: list[bytes] = []
    file = extract_module._Layer._file
    monkeypatch.setattr(extract_module._Layer, "_file", lambda self, tar, m, dirs, name: (
        by_python.append(m.name), file(self, tar, m, dirs, name))[1])
    fast = _outcome(data, tmp_path / "fast", True, then=then, budget=budget)
    assert fast[0] == "tree"
    # extract.py wrote only the file over GROW (each time) and the file on a directory;
    # the second layer's first entry, in a lower directory not yet in the chain, is the
    # C run's (it opens that directory itself)
    assert sorted(by_python) == [b"big/dir", b"big/huge", b"big/huge"], by_python
    assert fast == _outcome(data, tmp_path / "slow", False, then=then, budget=budget)


@needs_native
def test_the_c_run_makes_the_directories_and_symlinks_of_a_fresh_layer_itself(tree,
                                                                          monkeypatch):
    # Without this, the differential tests would pass with a C run that applies nothing.
    by_python: list[bytes] = []
    for step in ("_file", "_dir", "_symlink"):
        original = getattr(extract_module._Layer, step)
        monkeypatch.setattr(extract_module._Layer, step, lambda self, *a, _o=original: (
            by_python.append(self.raw), _o(self, *a))[1])
    tree.apply(*_nested_entries()[:12])
    # n/a/b/deep too, whose parent the chain had left for n/c and the root: the run opens
    # n, n/a and n/a/b again itself
    assert by_python == [], by_python
    assert [e.path for e in manifest(tree.fd)][:6] == [".", "n", "n/a", "n/a/b", "n/a/b/deep",
                                                       "n/a/b/deep/j"]


@needs_native
def test_the_c_run_opens_a_lower_directory_itself_but_leaves_what_it_must_not_reach(
        tree, monkeypatch):
    # Below a directory of a lower layer with owner rwx the run opens it (O_NOFOLLOW) and
    # writes; a missing parent (made by extract.py), one without owner rwx (which
    # extract.py opens up when unprivileged) and a symlink (refused) are extract.py's.
    tree.apply(folder("ok"), folder("ro", 0o555), sym("link", "ok"), reg("top", b"t"))
    by_python: list[bytes] = []
    original = extract_module._Layer._file
    monkeypatch.setattr(extract_module._Layer, "_file", lambda self, *a: (
        by_python.append(self.raw), original(self, *a))[1])
    tree.apply(reg("top", b"again"), reg("ok/x", b"x"), reg("ok/x2", b"x2"),
               reg("ro/y", b"y"), reg("missing/z", b"z"), reg("ok/x3", b"x3"))
    assert by_python == [b"ro/y", b"missing/z"], by_python
    assert {p: (tree.path / p).read_bytes() for p in ("top", "ok/x", "ok/x3", "ro/y",
                                                      "missing/z")} == {
        "top": b"again", "ok/x": b"x", "ok/x3": b"x3", "ro/y": b"y", "missing/z": b"z"}
    tree.refused("IMG-SYMLINK-01", reg("top", b"3"), reg("link/w", b"w"))
    assert sorted(os.listdir(tree.path / "ok")) == ["x", "x2", "x3"]


@needs_native
@pytest.mark.parametrize("cut", ["in a file's padding", "in a file's data", "in a header"])
def test_IMG_TAR_01_a_layer_cut_short_is_refused_alike_with_and_without_the_c_run(tmp_path,
                                                                                cut):
    big = fastpath.GROW + 100  # applied by extract.py, whose padding the C run reads past
    data = layer(reg("small", b"s" * 100), reg("big", b"b" * big), reg("after", b"a")
                 ).getvalue()
    end = {"in a file's padding": 512 + 512 + 512 + big,
           "in a file's data": 512 + 512 + 512 + big // 2,
           "in a header": 512 + 512 + 512 + big + (-big % 512) + 100}[cut]
    budget = LayerBudget(max_bytes=64 << 20, max_file_size=16 << 20)
    fast = _outcome(data[:end], tmp_path / "fast", True, budget=budget)
    assert fast == ("refused", "IMG-TAR-01")
    assert fast == _outcome(data[:end], tmp_path / "slow", False, budget=budget)


@needs_native
def test_the_c_fast_path_keeps_what_a_layer_made_below_a_lower_directory(tmp_path):
    # After a whiteout (which adds nothing), the C run writes a/b/f into the lower a/b:
    # the layer's later .wh.b must keep it, and delete what the lower layer put there.
    lower = layer(folder("a"), folder("a/b"), reg("a/b/old", b"o"), reg("a/b/gone", b"g"))
    upper = layer(reg("a/b/.wh.gone"), reg("a/b/f", b"f"), reg("a/b/f2", b"f2"),
                  reg("a/.wh.b"))
    fast = _outcome(lower.getvalue(), tmp_path / "fast", True, then=upper.getvalue())
    assert fast == _outcome(lower.getvalue(), tmp_path / "slow", False,
                            then=upper.getvalue())
    assert [e.path for e in fast[1]] == [".", "a", "a/b", "a/b/f", "a/b/f2"]


@needs_native
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to the image's ids)")
def test_the_c_fast_path_gives_the_images_ids_as_image_ids_does(tmp_path):
    members = [reg("f", b"x", uid=7, gid=8), reg("g", b"y", uid=70_000, gid=9),
               sym("s", "f"), *_many_entries()]
    data = layer(*members).getvalue()
    fast = _outcome(data, tmp_path / "fast", True, ids=image_ids)
    assert fast == _outcome(data, tmp_path / "slow", False, ids=image_ids)
    owners = {e.path: (e.uid, e.gid) for e in fast[1]}
    assert owners["f"] == (7, 8) and owners["g"] == (65534, 9)


@needs_native
def test_IMG_TAR_01_the_c_fast_path_refuses_what_extract_py_refuses_under_mutation(tmp_path):
    # The same 400-case mutation as above, each layer applied with and without the C run:
    # the same refusal (by rule) or the same tree, and nothing outside it touched.
    good = layer(*_many_entries()[:40], reg("d0/.wh.f2"), reg("../x", b"out"),
                 fmt=tarfile.USTAR_FORMAT).getvalue()
    with tarfile.open(fileobj=io.BytesIO(good)) as tar:
        headers = [m.offset for m in tar.getmembers()]
    rng = random.Random(11)
    for i in range(400):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            at = rng.choice(headers) + rng.randrange(512) if rng.random() < 0.9 else \
                rng.randrange(len(data))
            data[at] = rng.choice([0, 0x2F, 0x2E, 0x30, 0x32, 0x35, 0x37, 0x77, 0x68, 0x80,
                                   0xFF, rng.randrange(256)])
            if rng.random() < 0.8:
                _fix_checksum(data, at - at % 512)
        fast = _outcome(bytes(data), tmp_path / f"fast{i}", True)
        slow = _outcome(bytes(data), tmp_path / f"slow{i}", False)
        assert fast == slow, i
        for which in ("fast", "slow"):
            subprocess.run(["chmod", "-R", "u+rwx", tmp_path / f"{which}{i}"], check=True)
            shutil.rmtree(tmp_path / f"{which}{i}")


# -- the C run's files finished by the thread that hashes them (FileHashes, Batch.finish)

def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@needs_native
def test_the_c_run_leaves_its_files_open_for_the_hashing_thread_and_every_fd_is_closed(
        tmp_path, monkeypatch):
    # 300 files in one directory, more than RLIMIT_NOFILE / 4 of them: the run leaves at
    # most that many open for Batch.finish (writes the rest itself) and the tree is the
    # one extract.py makes. Not one fd outlives the layer.
    import resource
    members = [folder("d")] + [reg(f"d/f{i}", os.urandom(i * 13), mtime=5_000 + i)
                               for i in range(300)]
    data = layer(*members).getvalue()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    left_open: list[int] = []
    finish = fastpath.Batch.finish

    def counting(batch):
        raw = [batch._done[i] for i in range(batch._n)]
        left_open.append(sum(1 for d in raw if d.kind == fastpath._FILE and d.fd >= 0))
        assert batch._count.open <= batch._count.open_max
        return finish(batch)

    monkeypatch.setattr(fastpath.Batch, "finish", counting)
    before = _open_fds()
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        fast = _outcome(data, tmp_path / "fast", True)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert _open_fds() == before
    assert fast[0] == "tree" and fast == _outcome(data, tmp_path / "slow", False)
    assert sum(left_open) > 0 and max(left_open) <= 256 // 4, left_open


_FULL_DISK = r"""
import io, json, os, sys, tarfile
from karotte.images.extract import LayerError, apply_layer
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w") as tar:
    for i in range(40):
        info = tarfile.TarInfo(f"f{i:02}"); info.size = 64 << 10
        tar.addfile(info, io.BytesIO(os.urandom(info.size)))
buf.seek(0)
before = sorted(os.listdir("/proc/self/fd"))
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
try:
    apply_layer(buf, fd, hashes={})
    out = {"refused": None}
except LayerError as exc:
    out = {"refused": exc.rule, "detail": exc.detail}
os.close(fd)
out["fds_kept"] = sorted(os.listdir("/proc/self/fd")) == before
print(json.dumps(out))
"""


@needs_native
def test_IMG_WRITE_01_a_write_the_hashing_thread_does_that_fails_names_the_file(tmp_path):
    # A 1 MiB tmpfs (of a user and mount namespace of this test's own) takes the files'
    # names and sizes (ftruncate allocates nothing) but not 40 x 64 KiB of data: the
    # write left to Batch.finish fails, and the layer is refused naming that file.
    disk = tmp_path / "small"
    disk.mkdir()
    script = tmp_path / "full.py"
    script.write_text(_FULL_DISK)
    import sys
    run = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         f'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$2" "$3" "$1"', "sh", str(disk),
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(extract_module.__file__).parents[2])})
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["refused"] == "IMG-WRITE-01", out
    assert out["detail"].startswith("f") and "No space left on device" in out["detail"], out
    assert out["fds_kept"], out


def test_file_hashes_runs_each_run_once_in_order_on_either_thread_even_after_an_error():
    # FileHashes's contract, without a kernel in the way: every run is run exactly once
    # (a run may hold open files), by the thread or by the extracting thread where it
    # would wait (help, a full queue, close), and close() gives the results in order,
    # then raises what a run raised.
    import threading
    ran: list[int] = []
    threads: set[str] = set()
    hashes: dict = {}
    fh = tree_module.FileHashes(hashes)

    def run(i: int):
        def files():
            ran.append(i)
            threads.add(threading.current_thread().name)
            if i == 150:
                raise OSError(28, "No space left on device", "f150")
            return [(i % 7, i, f"{i:064x}")]  # inodes used again: the later run wins
        return files

    started, gate = threading.Event(), threading.Event()

    def first():
        started.set()  # the thread has it: the queue fills while it waits
        assert gate.wait(10)
        return run(0)()

    fh.later(first)
    assert started.wait(10)
    for i in range(1, 200):
        fh.later(run(i))  # past the queue's room, this thread runs the oldest run itself
        if i % 3 == 0:
            fh.help()
        if i == 100:
            gate.set()
    with pytest.raises(OSError) as info:
        fh.close()
    assert info.value.filename == "f150"
    assert sorted(ran) == list(range(200))
    assert threads == {"MainThread", "karotte-file-hash"}, threads

    ok = tree_module.FileHashes(hashes := {})
    for i in range(100):
        ok.later(run(200 + i))
    ok.close()
    assert hashes == {ino: (size, f"{size:064x}") for ino, size in
                      {(i % 7): i for i in range(200, 300)}.items()}


@needs_native
def test_reads_through_the_blob_thread_join_only_what_an_entry_needs_and_make_the_same_tree(
        tmp_path, monkeypatch):
    # Files of 200-900 KB straddle the 1 MiB chunks of blobs.Tee: an entry cut by a
    # chunk's end is joined with only as much of the next chunk as it needs (and HEAD
    # more); the rest of that chunk is the next view, not copied. The tree and the hashes
    # are those of the same layer read in one piece.
    from karotte.images import blobs
    rng = random.Random(9)
    members = [folder("d")] + [reg(f"d/f{i}", rng.randbytes(rng.randrange(200_000, 900_000)))
                               for i in range(40)]
    data = layer(*members).getvalue()
    joined: list[int] = []
    join = blobs.Tee._join

    def counting(self, rest, buf, at, end, want):
        view = join(self, rest, buf, at, end, want)
        joined.append(len(view))
        return view

    monkeypatch.setattr(blobs.Tee, "_join", counting)
    results = []
    copy = blobs.BlobCopy(None)
    for name, stream in (("tee", blobs.Tee(io.BytesIO(data), copy, lambda done, total: None,
                                           len(data))), ("whole", io.BytesIO(data))):
        (tmp_path / name).mkdir()
        t = Tree(tmp_path / name)
        hashes: dict = {}
        apply_layer(stream, t.fd, hashes=hashes, budget=LayerBudget(max_bytes=64 << 20))
        results.append((manifest(t.fd, hashes), manifest(t.fd)))
        os.close(t.fd)
        t.untouched()
    copy.close()
    assert results[0] == results[1] and results[0][0] == results[0][1]
    assert joined and max(joined) < blobs.CHUNK, joined  # never a whole chunk copied again


@needs_native
def test_a_hashing_thread_that_cannot_start_leaves_no_fd_open_and_its_error_is_the_one(
        tree, monkeypatch):
    # A trainer at its pids limit: the layer's first run (its files left open) cannot go
    # to a thread. The run is finished here, nothing stays open, and the error raised is
    # the thread's own, not one of close() after it.
    import threading

    def cannot(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", cannot)
    before = _open_fds()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        apply_layer(layer(folder("d"), *[reg(f"d/f{i}", b"x" * i) for i in range(50)]),
                    tree.fd, hashes={})
    assert _open_fds() == before
    assert all((tree.path / "d" / f"f{i}").read_bytes() == b"x" * i for i in range(50)
               if (tree.path / "d" / f"f{i}").exists())


@needs_native
def test_a_layer_refused_while_a_deferred_write_fails_is_refused_by_its_own_rule(
        tree, monkeypatch):
    # The layer's refusal (IMG-SYMLINK-01) is the error reported, not IMG-WRITE-01 of a
    # write that failed on the hashing thread meanwhile; alone, that write refuses it.
    finish = fastpath.Batch.finish

    def failing(batch):
        finish(batch)
        raise OSError(28, "No space left on device", batch.paths[0])

    monkeypatch.setattr(fastpath.Batch, "finish", failing)
    tree.apply(folder("ok"))

    def refused(*members: tuple) -> LayerError:
        with pytest.raises(LayerError) as info:
            apply_layer(layer(*members), tree.fd, hashes={})
        return info.value

    assert refused(sym("link", "ok"), reg("f", b"f"), reg("link/w", b"w")).rule == \
        "IMG-SYMLINK-01"
    error = refused(reg("g", b"g"))
    assert (error.rule, error.detail) == ("IMG-WRITE-01", "g: No space left on device")
