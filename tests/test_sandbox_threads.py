"""A sync Sandbox runs one exec at a time: a second one while the first runs (from another
thread, or from the first's on_output callback) would read init's replies beside it, and
each drops the other's as stale, so one of them could wait for its exit forever. It is
refused at once, naming the fix; the first exec, and the sandbox, go on unharmed."""
from __future__ import annotations

import threading
import time

from conftest import needs_sandbox
from karotte.errors import SandboxError
from karotte.sandbox import Sandbox

pytestmark = needs_sandbox()

HANG = 30  # seconds after which a thread still in exec counts as hung


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    done: dict = {}

    def run():
        try:
            done["result"] = fn()
        except Exception as exc:  # noqa: BLE001 (the test asserts which)
            done["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def test_a_second_exec_from_another_thread_fails_at_once_naming_the_fix(no_leaks):
    with Sandbox() as sb:
        # Each of many short execs overlaps the long one: before, they raced it for init's
        # replies, and one of the two hung (or both ran, unchecked).
        first, ran = _in_thread(lambda: sb.exec(["sleep", "2"], timeout=20))
        time.sleep(0.5)  # the first is running
        start = time.monotonic()
        second, refused = _in_thread(lambda: [sb.exec(["true"], timeout=5) for _ in range(20)])
        second.join(HANG)
        took = time.monotonic() - start
        first.join(HANG)
        assert not first.is_alive() and not second.is_alive(), "an exec hung"
        assert isinstance(refused.get("error"), SandboxError), refused
        assert took < 1.0, took
        message = str(refused["error"])
        assert "one exec at a time" in message and "one Sandbox per thread" in message
        assert "AsyncSandbox" in message
        assert ran["result"].exit_code == 0, ran
        assert sb.exec(["true"]).exit_code == 0  # the sandbox is as it was


def test_an_exec_from_an_on_output_callback_is_refused_and_the_first_goes_on(no_leaks):
    with Sandbox() as sb:
        nested: list = []

        def on_output(stream: int, data: bytes) -> None:
            try:
                nested.append(sb.exec(["true"], timeout=5))
            except SandboxError as exc:
                nested.append(exc)
        outer, ran = _in_thread(lambda: sb.exec("echo one; sleep 0.5; echo two", timeout=10,
                                                on_output=on_output))
        outer.join(HANG)
        assert not outer.is_alive(), "the outer exec hung"
        assert ran["result"].exit_code == 0 and ran["result"].stdout == b"one\ntwo\n", ran
        assert nested and all(isinstance(n, SandboxError) for n in nested), nested
        assert "one exec at a time" in str(nested[0])
