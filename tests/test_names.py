"""Names that say who made a host object (karotte/names.py), read back from /proc."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys
with open("/proc/self/comm", "wb") as f:
    f.write("träiner é".encode())  # a command name that is not ASCII (and has a space)
from karotte import names
name = names.leaf_name("x")
print(name, names.creator_alive(name))
"""


def test_a_creator_whose_command_name_is_not_ascii_still_gets_names_and_is_seen_alive():
    # /proc/<pid>/stat carries the command name before the start time: a reader that
    # decodes it strictly crashed leaf_name(), and gc could not judge such a creator.
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    name, alive = r.stdout.split()
    assert name.startswith("karotte-") and name.endswith("-x") and alive == "True"
