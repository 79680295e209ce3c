"""REC-BOUND-01: the records a trainer keeps (Outcome, its JSON) stay bounded, whatever the
agent made, printed or typed. The scan's own bounds are in test_scan.py."""
from __future__ import annotations

import json

import psutil

from envs.basic import Addition
from envs.records import NoisyGrader
from karotte.episode import Episode
from karotte.results import json_size
from karotte.spec import KiB, MiB

# Within the sandbox's 65,536 inodes: FIFOs, symlinks with 200-byte names, and FIFOs at
# the bottom of 30 directories of 200-byte names (6 KiB paths), made in about a second.
HOSTILE = """
import os
os.chdir('/workspace')
for i in range(20_000):
    os.mkfifo(f'fifo{i:05d}')
for i in range(20_000):
    os.symlink('/etc/passwd', f'link{i:05d}' + 'l' * 191)
for _ in range(30):
    os.mkdir('d' * 200)
    os.chdir('d' * 200)
for i in range(2_000):
    os.mkfifo(f'deep{i:04d}')
"""


def test_REC_BOUND_01_a_hostile_workspace_makes_a_record_under_1_MiB_in_bounded_time_and_memory(
        no_leaks):
    process = psutil.Process()
    with Episode(Addition(), seed=1) as ep:
        ep.reset()
        ep.write_file("/tmp/hostile.py", HOSTILE)
        made = ep.exec("python3 -I /tmp/hostile.py && "
                       "read a b < numbers.txt && echo $((a + b)) > answer.txt")
        assert made.exit_code == 0, made.text
        rss = process.memory_info().rss
        outcome = ep.finish()
        text = json.dumps(outcome.to_dict())
        grown = process.memory_info().rss - rss
    assert (outcome.reward, outcome.reason) == (1.0, "graded")  # the rest is left out
    assert len(outcome.violations) == 100
    assert outcome.violations_dropped == 42_000 - 100
    # Before the bounds: 42,000 violations, 21 MB of JSON, and 27 to 47 MiB more RSS.
    # Now: 115 KB of JSON, and about 2.5 MiB more RSS (the names the scan lists).
    assert len(text) < 1 * MiB, f"the record is {len(text)} bytes"
    assert outcome.timings.scan < ep.env.scan_limits.max_seconds
    assert grown < 16 * MiB, f"the trainer's RSS grew by {grown / MiB:.0f} MiB"


def test_REC_BOUND_01_a_logged_command_is_cut_to_4_KiB_of_json(no_leaks):
    command = "true # " + "\u00e9" * 60_000  # 120 KB: as much as one argument may be
    with Episode(Addition(), seed=1) as ep:
        ep.reset()
        assert ep.exec(command).exit_code == 0  # it ran whole
        (record,) = ep.finish().log
    assert json_size(record.argument) <= 4 * KiB
    assert record.argument.startswith("true # \u00e9")
    assert record.argument.endswith(f"[karotte: cut, {len(command)} characters in all]")


def test_REC_BOUND_01_the_graders_log_is_kept_up_to_64_KiB_of_json(no_leaks):
    # 64 KiB of bytes that are not UTF-8 become 64 Ki replacement characters, 6 bytes
    # each in JSON: 384 KiB.
    with Episode(NoisyGrader(), seed=1) as ep:
        ep.reset()
        outcome = ep.finish()
    assert outcome.reason == "graded"
    assert outcome.grader_log.startswith("\ufffd")
    assert json_size(outcome.grader_log) <= 64 * KiB


def test_REC_BOUND_01_an_infra_error_is_cut_to_4_KiB_of_json():
    # Errors can carry agent-made text (a path in the scan's ScanError, a grader's output).
    flow = Episode(Addition(), seed=1)._flow
    outcome = flow.outcome(None, "infra_error", infra_error="custody failed: " + "\x01" * 50_000)
    assert json_size(outcome.infra_error) <= 4 * KiB
    assert outcome.infra_error.startswith("custody failed: \x01")
