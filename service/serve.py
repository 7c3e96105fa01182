"""The processes of ``foldwise serve``: HTTP processes apart from the tuning workers.

``foldwise serve --processes N --workers W`` runs:

- **the HTTP API** in ``N`` uvicorn processes sharing one listening socket (``N`` = 1: in
  this process; ``N`` > 1: ``uvicorn.run(workers=N)``, uvicorn's own supervisor, which
  restarts a process that dies). Each process builds its app with :func:`http_app` from
  the same :class:`~service.settings.Settings`, passed as JSON in ``FOLDWISE_SERVE_SETTINGS``
  (spawned processes inherit the environment). uvicorn takes ``httptools`` and ``uvloop`` when
  they are installed (``http="auto"``, ``loop="auto"``), else h11 and asyncio;
- **the tuning workers** (``W`` threads per target of ``--targets``, default the one
  ``--target``) in *one* process of their own (:func:`tuning_process`), started here, never
  inside an HTTP process: a search holds the GIL for long stretches (sympy, Triton's
  interpreter, Optuna), and in an HTTP process it would stall the event loop.

Stopping: SIGTERM or SIGINT to ``serve`` stops accepting, lets the requests in flight finish,
and stops the tuning process at once (SIGTERM). Its workers have :data:`WORKER_STOP_S` to end
their trial and give their job back; the jobs of those that did not are given back by the
process itself (:func:`service.store.job_queue.release_worker_jobs`: a late write of theirs is then
refused), and it exits without waiting for them. So ``serve`` stops within a few seconds, and
no job waits for a lease to expire (nor counts a lost worker). The tuning process also stops by
itself when its parent is gone, so a killed ``serve`` leaves no tuner behind.

Why uvicorn's supervisor and not gunicorn: it is already a dependency, it runs where gunicorn
does not (Windows, for a laptop), it restarts dead processes and stops them all on a signal,
which is all ``serve`` needs; gunicorn would add a dependency and a second configuration
language for the same pre-fork model.

The processes share the database: PostgreSQL, or the SQLite file in WAL mode with a 30 s
``busy_timeout`` and ``BEGIN IMMEDIATE`` (service/store/db.py), one writer at a time.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import multiprocessing
import os
import signal
import threading
from typing import Any

from service.settings import Settings

log = logging.getLogger("foldwise.serve")
SETTINGS_ENV = "FOLDWISE_SERVE_SETTINGS"
LOG_LEVEL_ENV = "FOLDWISE_SERVE_LOG_LEVEL"
WORKER_STOP_S = 2.5  # a stopping tuning process waits this long for its workers, then gives their jobs back
TUNING_STOP_S = 4.5  # serve waits this long for the tuning process, then kills it


def fast_extras() -> dict[str, str]:
    """What uvicorn's ``auto`` picks here: the HTTP parser and the event loop."""
    def have(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return {"http": "httptools" if have("httptools") else "h11", "loop": "uvloop" if have("uvloop") else "asyncio"}


def http_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options that bound a request's head and the connections (service/http/limits.py),
    with the open-file limit raised first."""
    from service.http.limits import raise_open_file_limit, uvicorn_http_options

    raise_open_file_limit()
    return uvicorn_http_options(settings.max_header_bytes, settings.header_timeout_seconds, settings.max_connections)


def http_app() -> Any:
    """The app of one HTTP process (a uvicorn factory): the parent's settings, JSON logs."""
    from service.api import create_app
    from service.logs import configure_logging

    from service.http.limits import set_head_limits

    configure_logging(os.environ.get(LOG_LEVEL_ENV, "info"))
    settings = Settings.model_validate_json(os.environ[SETTINGS_ENV])
    set_head_limits(settings.max_header_bytes, settings.header_timeout_seconds)  # for this process's protocol
    app = create_app(settings)
    freeze_startup_heap()
    return app


def freeze_startup_heap() -> None:
    """What a server process holds once its app is made (sympy, the derivation, the routes: 130k
    objects) is kept out of the garbage collector's full passes, which took ~80 ms each on the event
    loop on a 2-core machine (``gc.freeze``: the objects stay; only their traversal stops). A server
    process's only: a test session making many apps would keep their cycles forever."""
    gc.collect()
    gc.freeze()


def serve(settings: Settings, *, processes: int, measurer: str, log_level: str,
          targets: list[str] | None = None) -> None:
    """Run the API in ``processes`` processes and the tuning workers (``settings.workers`` per
    target of ``targets``, default ``[settings.target]``) in one more, until a signal."""
    targets = list(targets or [settings.target])
    tuning = start_tuning_process(settings, measurer, log_level, targets) if settings.workers else None
    log.info("serving", extra={"url": f"http://{settings.host}:{settings.port}", "processes": processes,
                               "workers": settings.workers, "measurer": measurer, "target": settings.target,
                               "targets": targets, "tuning_pid": tuning.pid if tuning else None,
                               "derive_workers": settings.derive_workers, **fast_extras()})
    try:
        if processes == 1:
            _serve_here(settings, log_level, tuning)
        else:
            _serve_processes(settings, processes, log_level)
    finally:
        if tuning is not None:
            stop_process(tuning)


def _serve_here(settings: Settings, log_level: str, tuning: Any = None) -> None:
    import uvicorn

    from service.api import create_app

    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port, log_config=None,
                            access_log=False, log_level=log_level, timeout_graceful_shutdown=10,
                            **http_options(settings))
    server = _Server(config)
    freeze_startup_heap()
    previous = _shutdown_on_signals(server, tuning)
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve_processes(settings: Settings, processes: int, log_level: str) -> None:
    import uvicorn

    os.environ[SETTINGS_ENV] = settings.model_dump_json()
    os.environ[LOG_LEVEL_ENV] = log_level
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:  # uvicorn's supervisor: on SIGTERM/SIGINT it stops, terminates and joins the processes, and returns
        uvicorn.run("service.serve:http_app", factory=True, workers=processes, host=settings.host,
                    port=settings.port, log_config=None, access_log=False, log_level=log_level,
                    timeout_graceful_shutdown=10, **http_options(settings))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _Server(config: Any) -> Any:
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its own signal handling: after a graceful shutdown uvicorn
        re-raises the signal, which would end this process before it stops the tuning
        process; :func:`_shutdown_on_signals` handles SIGTERM/SIGINT instead."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            yield

    return Server(config)


def _shutdown_on_signals(server: Any, tuning: Any = None) -> dict[int, Any]:
    """SIGTERM/SIGINT: stop accepting, finish the requests in flight, and tell the tuning
    process to stop meanwhile (not after); a second signal: at once."""
    def handler(signum: int, frame: Any) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True
        if tuning is not None and tuning.is_alive():
            tuning.terminate()

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


# ----------------------------------------------------------------------------- tuning workers


def start_tuning_process(settings: Settings, measurer: str, log_level: str,
                         targets: list[str] | None = None) -> multiprocessing.process.BaseProcess:
    """The tuning workers' process (spawned: a fresh interpreter, no state inherited)."""
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=tuning_process, name="foldwise-tuning", daemon=False,
                              args=(settings.model_dump_json(), measurer, log_level, os.getpid(),
                                    list(targets or [settings.target])))
    process.start()
    return process


def stop_process(process: multiprocessing.process.BaseProcess, timeout_s: float = TUNING_STOP_S) -> None:
    """SIGTERM, wait ``timeout_s``, then SIGKILL: the process is gone when this returns."""
    if process.is_alive():
        process.terminate()
        process.join(timeout_s)
    if process.is_alive():
        log.warning("tuning process did not stop in time; killed", extra={"pid": process.pid})
        process.kill()
    process.join()


def tuning_process(settings_json: str, measurer: str, log_level: str, parent_pid: int,
                   targets: list[str] | None = None) -> None:
    """Run ``settings.workers`` job-queue workers (threads) per target until SIGTERM/SIGINT or
    the parent is gone; then stop within :data:`WORKER_STOP_S` (module docstring)."""
    import time

    from service.logs import configure_logging
    from service.worker import new_worker_id

    configure_logging(log_level)
    settings = Settings.model_validate_json(settings_json)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    workers = [(target, f"{new_worker_id()}-{target}-t{i}") for target in (targets or [settings.target])
               for i in range(settings.workers)]
    threads = [threading.Thread(target=_worker_thread, args=(settings, measurer, stop, target, worker_id),
                                daemon=True, name=f"foldwise-worker-{worker_id[-12:]}")
               for target, worker_id in workers]
    for t in threads:
        t.start()
    while not stop.wait(0.25):
        if os.getppid() != parent_pid:  # serve was killed: do not tune on as an orphan
            log.warning("serve is gone; the tuning workers stop")
            stop.set()
    deadline = time.monotonic() + WORKER_STOP_S
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):  # mid-trial (or mid-start): their jobs go back now
        _release_jobs(settings.db_url, [worker_id for _, worker_id in workers])
    logging.shutdown()
    os._exit(0)  # not waiting for the threads still in a trial, nor the compile pool (it exits with us)


def _release_jobs(db_url: str, worker_ids: list[str]) -> None:
    from service.store import job_queue
    from service.store.db import make_engine, session_factory

    engine = make_engine(db_url)
    try:
        with session_factory(engine)() as session:
            released = job_queue.release_worker_jobs(session, worker_ids)
        if released:
            log.info("jobs given back by the stopping tuning process", extra={"jobs": released})
    except Exception:  # noqa: BLE001 - the leases expire; another worker takes the jobs over
        log.exception("could not give the jobs back; their leases will expire")
    finally:
        engine.dispose()


def _worker_thread(settings: Settings, measurer: str, stop: threading.Event, target: str, worker_id: str) -> None:
    from service.worker import run_worker

    try:
        run_worker(settings.db_url, measurer=measurer, target=target, stop=stop, settings=settings,
                   worker_id=worker_id)
    except Exception:  # the API keeps serving; the log says why this worker is gone
        log.exception("tuning worker stopped", extra={"worker_id": worker_id, "target": target})
