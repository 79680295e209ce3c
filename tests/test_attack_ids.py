"""docs/attacks.md and the tests agree: every attack it lists as defended has a test
named after its ID (test_FS_FIFO_01_...), so `grep -rn test_ID tests/` finds what stops
it, and every test named after an ID is listed there."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ID = r"[A-Z]+-[A-Z0-9]+-\d\d"
# A row says "(open)", "(not applicable)" or "(out of scope)" after an ID it does not defend.
ROW = re.compile(rf"^\| ({ID})( \((?:open|not applicable|out of scope)\))? \|", re.M)


def _documented() -> dict[str, bool]:
    """ID -> whether it is defended (not marked open, not applicable or out of scope)."""
    text = (ROOT / "docs" / "attacks.md").read_text()
    return {m.group(1): not m.group(2) for m in ROW.finditer(text)}


def _tested() -> set[str]:
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for m in re.finditer(r"def test_([A-Z]+_[A-Z0-9]+_\d\d)_", path.read_text()):
            names.add(m.group(1).replace("_", "-"))
    return names


def test_every_defended_attack_of_the_docs_has_a_test_named_after_it():
    documented, tested = _documented(), _tested()
    assert len(documented) > 50
    assert sorted(i for i, defended in documented.items() if defended and i not in tested) == []


def test_every_test_named_after_an_attack_is_in_the_docs():
    assert sorted(_tested() - set(_documented())) == []
