"""The API's children bound themselves (service/api/child_bounds.py, issue 37, 6): they die with
their parent (a SIGKILLed API left its derivation running), and their heap is capped (a valid
spec's derivation took 1 GB)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from service.api.child_bounds import bound_child


def _allocate(conn, cap: int, size: int) -> None:
    bound_child(cap)
    try:
        block = bytearray(size)
        conn.send(("ok", len(block)))
    except MemoryError:
        conn.send(("MemoryError", 0))


def test_a_childs_heap_is_capped() -> None:
    context = multiprocessing.get_context("spawn")
    for size, want in ((64 << 20, "ok"), (1 << 30, "MemoryError")):
        mine, theirs = context.Pipe(duplex=False)
        child = context.Process(target=_allocate, args=(theirs, 256 << 20, size))
        child.start()
        theirs.close()
        assert mine.recv()[0] == want, size
        child.join(30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_parent() -> None:
    """A parent process starts a bound child (as the forkserver starts a derivation) and is
    SIGKILLed: the child is gone within seconds, not left to run its work to the end."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import multiprocessing, sys, time
        from service.api.child_bounds import bound_child

        def work():
            bound_child()
            time.sleep(120)

        if __name__ == "__main__":
            child = multiprocessing.get_context("fork").Process(target=work, daemon=False)
            child.start()
            print(child.pid, flush=True)
            time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        pid = int(parent.stdout.readline())
        time.sleep(1.0)  # the child has armed its signal (bound_child is its first call)
        os.kill(pid, 0)  # alive
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            if _zombie(pid):
                return
            time.sleep(0.1)
        raise AssertionError(f"child {pid} outlived its SIGKILLed parent")
    finally:
        parent.kill()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
