"""Bounds on the child processes the API starts for a request's CPU work (the derivations of
service/api/derive.py, the spec parser of service/api/spec_child.py), set by the child on itself
before it reads its work (issue 37, 6):

- **It dies with its parent.** The children are forked by multiprocessing's forkserver, which exits
  when the API's process does (its pipe from the API closes); a SIGKILLed API left its derivation
  running to the end (57-93 s of CPU). Linux's ``PR_SET_PDEATHSIG`` sends the child SIGKILL when
  its parent (the forkserver) exits, so the chain ends with the API. Elsewhere: not available, the
  deadline's kill still applies while the API lives.
- **Its memory is capped.** A valid 1.3 KB spec (two top-k of k = 1024) took 1.0 GB; a child's data
  segment (the heap, every anonymous mapping malloc makes) is limited to :data:`CHILD_MEMORY_BYTES`
  (``RLIMIT_DATA``: unlike the address-space limit it leaves the shared libraries' mappings out, so
  the cap is on what the work allocates). Past it an allocation fails with MemoryError, which the
  child answers as a limit (422 naming ``spec``), not a crash.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

CHILD_MEMORY_BYTES = 2 << 30  # 2 GiB of heap per child: the catalog's derivations take under 300 MB
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def bound_child(memory_bytes: int = CHILD_MEMORY_BYTES) -> None:
    """In a child process, first thing: die with the parent, and cap the heap at ``memory_bytes``."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() == 1:
            os._exit(0)  # the parent exited before the signal was armed: nobody waits for this work
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
    if soft == resource.RLIM_INFINITY or soft > cap:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))


def memory_message(memory_bytes: int = CHILD_MEMORY_BYTES) -> str:
    return f"it needed more than {memory_bytes >> 20} MB of memory (the limit per derivation)"



def lower_priority(nice: int) -> None:
    """In a child process: run ``nice`` steps below the API, so the event loop and its threads keep
    their share of the CPU. Not the idle scheduling class: beside busy tuning workers a derivation
    would then never run, and every request would meet its deadline."""
    try:
        os.nice(nice)
    except OSError:
        pass
