"""Waiting for a child process's answer on the API's event loop, uvloop included.

The derivations (service/api/derive.py) and the spec parser (service/api/spec_child.py) answer
through a ``multiprocessing`` pipe. The loop is told when the pipe is readable (``add_reader``);
the answer is then read whole by ``Connection.recv()``, which expects a blocking descriptor. Under
asyncio's own loop it is one; uvloop's ``add_reader`` leaves it non-blocking, and a message
larger than the pipe's buffer (64 KB for ``os.pipe``) then raised BlockingIOError halfway: every
such derivation answered 500 on ``foldwise serve``, which runs uvloop, while the tests, on
TestClient's plain asyncio loop, passed (issue 37, 1). So the descriptor is made blocking again
once the wait is over, and the message is read in a thread: its tail may still be on its way
from the child, and the event loop must not wait for it (a child stopped mid-write would stall
every request). The thread's read ends when the message does, or at EOF when the caller kills
the child at its deadline.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any


async def wait_readable(conn: Any, deadline: float) -> bool:
    """Wait (on the loop) until ``conn`` has something to read or ``deadline`` (time.monotonic())
    passes; True when readable. The descriptor is blocking again afterwards, whatever the loop."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
    try:
        while not readable.done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait({readable}, timeout=left)
        return readable.done()
    finally:
        loop.remove_reader(fd)
        os.set_blocking(fd, True)  # uvloop's add_reader made it non-blocking: recv() and send() expect blocking


async def receive(conn: Any, deadline: float) -> Any:
    """The next message on ``conn``, read whole in a thread once it is readable. Raises TimeoutError
    past ``deadline`` (the caller kills the child, which ends the thread's read with EOF) and
    EOFError when the child closed its end without answering."""
    if not await wait_readable(conn, deadline):
        raise TimeoutError
    reading = asyncio.get_running_loop().run_in_executor(None, conn.recv)
    try:
        return await asyncio.wait_for(asyncio.shield(reading), timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        reading.add_done_callback(lambda f: f.cancelled() or f.exception())  # its EOF after the kill: no warning
        raise
