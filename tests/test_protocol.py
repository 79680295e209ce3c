"""The wire format: karotte/protocol.py agrees with csrc/protocol.h as the C compiler reads it,
every step code karotte-init can send has its row in karotte/steps.py, and a failure names
its step."""
from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import struct
from pathlib import Path

import pytest

from karotte import protocol, steps
from karotte.protections import PROTECTIONS
from karotte.sandbox import Sandbox
from karotte.spec import Bind, SandboxSpec

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("protocol_h", REPO / "scripts" / "protocol_h.py")
protocol_h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(protocol_h)
TEXT = protocol_h.HEADER.read_text()
CONSTANTS, STRUCTS = protocol_h.names(TEXT)
# protocol.py's name of each constant: KP_EXEC is EXEC, KT_ARGV is T_ARGV, KM_BIND is M_BIND.
PREFIXES = {"KP": "", "KT": "T_", "KM": "M_", "KMF": "MF_"}
LAYOUTS = {"kp_header": protocol._HEADER, "kp_record": protocol._RECORD,
           "kp_mount": protocol._MOUNT, "kp_rlimit": protocol._RLIMIT,
           "kp_rusage": protocol._RUSAGE}
needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                              reason="no C compiler (the build needs one)")


@pytest.fixture(scope="module")
def compiled() -> dict[str, tuple[int, ...]]:
    return protocol_h.compiled(CONSTANTS, STRUCTS)


def test_the_header_is_read_as_expected():
    assert len(CONSTANTS) > 40 and "KP_MAX_MSG" in CONSTANTS and "KS_EXECVE" in CONSTANTS
    assert STRUCTS["kp_mount"] == ["op", "flags", "mode", "uid", "gid", "pad", "size", "inodes"]


@needs_cc
def test_the_generated_module_is_protocol_h_as_the_compiler_reads_it():
    assert protocol_h.render(TEXT) == protocol_h.MODULE.read_text(), (
        "karotte/_protocol_h.py is stale: run scripts/protocol_h.py")


@needs_cc
def test_every_constant_of_protocol_h_has_its_value_in_protocol_py(compiled):
    assert protocol.MAX_MSG == compiled["KP_MAX_MSG"][0]
    for name in CONSTANTS:
        if name == "KP_MAX_MSG" or name.startswith("KS_"):
            continue
        prefix, rest = name.split("_", 1)
        assert getattr(protocol, PREFIXES[prefix] + rest) == compiled[name][0], name


@needs_cc
def test_every_step_code_has_its_name_in_protocol_py(compiled):
    names = [n for n in CONSTANTS if n.startswith("KS_")]
    codes = {compiled[n][0]: n for n in names}
    assert len(codes) == len(names), "two steps share a code"
    assert protocol.STEPS == {code: name[3:].lower().replace("_", "-")
                              for code, name in codes.items()}
    assert protocol.step_name(compiled["KS_MOUNT_PROC"][0]) == "mount-proc"


@needs_cc
def test_every_struct_is_packed_with_the_compilers_layout(compiled):
    assert set(LAYOUTS) == set(STRUCTS)
    for name, layout in LAYOUTS.items():
        assert layout.size == compiled[name][0], name
        packed = [(struct.calcsize(layout.format[:i]), struct.calcsize("=" + layout.format[i]))
                  for i in range(1, len(layout.format))]  # (offset, size) of each field
        assert packed == [compiled[f"{name}.{f}"] for f in STRUCTS[name]], name


def test_every_step_has_a_row_that_names_lines_of_check():
    assert set(steps.STEPS) == set(protocol.STEPS.values())
    for name, row in steps.STEPS.items():
        assert set(row.protections) <= set(PROTECTIONS), name
        assert row.fix == (steps.fix(row.protections[0]) if row.protections else None), name
    assert steps.step(None) == steps.step("unknown-999") == steps.Step()
    assert steps.step("bind-source").hint(errno.EACCES).startswith("the sandbox is built by")
    assert steps.fix("mount-setattr").startswith("karotte-init needs mount_setattr (Linux 5.12+)")
    with pytest.raises(ValueError):
        steps.fix("no-such-line")


@pytest.fixture
def replies(monkeypatch) -> list[protocol.Reply]:
    """Every reply the host parses from karotte-init."""
    seen = []
    parse = protocol.parse

    def spy(data: bytes) -> protocol.Reply:
        seen.append(parse(data))
        return seen[-1]

    monkeypatch.setattr(protocol, "parse", spy)
    return seen


def test_an_exec_that_cannot_start_names_its_step(replies):
    with Sandbox(SandboxSpec()) as sb:
        missing = sb.exec(["/no/such/program"])
        elsewhere = sb.exec(["/bin/true"], cwd="/no/such/dir")
        ok = sb.exec(["/bin/true"])
    assert missing.error == "execvp /no/such/program: No such file or directory"
    assert elsewhere.error == "chdir /no/such/dir: No such file or directory"
    assert ok.ok
    errors = [(r.step, r.u32(protocol.T_ERRNO)) for r in replies if r.type == protocol.EXEC_ERR]
    assert errors == [("execve", errno.ENOENT), ("chdir", errno.ENOENT)]
    assert all(r.step is None for r in replies if r.type != protocol.EXEC_ERR)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: init's root is then an unprivileged "
                    "host uid, which a 0700 directory of root's keeps out")
def test_a_setup_failure_names_its_step_beside_the_words(replies, tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    (hidden / "file").write_text("x")
    with pytest.raises(Exception, match="sandbox setup failed at 'bind source "):
        Sandbox(SandboxSpec(binds=(Bind(str(hidden / "file"), "/mnt/file"),)))
    [failure] = [r for r in replies if r.type == protocol.SETUP_ERR]
    assert failure.step == "bind-source" and failure.u32(protocol.T_ERRNO) == errno.EACCES
    assert failure.text(protocol.T_WHAT) == f"bind source {hidden / 'file'}"
