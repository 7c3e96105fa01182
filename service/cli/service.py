"""The service's commands of the ``foldwise`` CLI: ``serve``, ``worker`` (job-queue mode),
``db upgrade``/``db current``, ``binaries backfill`` and ``token create|revoke|list``.

Kept out of service/cli/__init__.py so the CLI module stays small; :func:`add_service_commands` adds
the parsers and service/cli/__init__.py's ``worker`` command calls :func:`cmd_worker_queue` when no
``--study`` is given. Exit codes as everywhere in the CLI: 0 ok, 2 bad input or a database
that cannot be used as is (the message says what to run), 1 an internal error.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from service.cli.errors import UsageError


def _settings(**overrides: Any):
    from pydantic import ValidationError

    from service.settings import get_settings

    try:
        return get_settings(**overrides)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or "settings"
        raise UsageError(f"--{field.replace('_', '-')} (or FOLDWISE_{field.upper()}): {first.get('msg')}") from None


def _engine(url: str):
    import sqlalchemy as sa

    from service.store.db import make_engine

    try:
        engine = make_engine(url)
        with engine.connect():
            pass
        return engine
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ValueError) as err:
        raise UsageError(f"--db: not a database URL this build can open ({url!r}): {err}") from None
    except sa.exc.OperationalError as err:
        raise UsageError(f"--db: cannot connect to {url!r}: {str(err.orig).strip() or err}") from None


def _is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def _current_or_exit(engine) -> None:
    from service.store.db import DatabaseBehind, check_current

    try:
        check_current(engine)
    except DatabaseBehind as err:
        raise UsageError(str(err)) from None


# ----------------------------------------------------------------------------- db


def cmd_db(args: argparse.Namespace) -> int:
    from service.store.db import current_revision, head_revision, upgrade

    settings = _settings(db_url=args.db)
    engine = _engine(settings.db_url)
    try:
        if args.action == "upgrade":
            before = current_revision(engine)
            upgrade(settings.db_url)
            after = current_revision(engine)
            print(f"database at revision {after}" + (" (unchanged)" if before == after else f" (was {before})"))
        else:
            current, head = current_revision(engine), head_revision()
            print(f"database at revision {current}; code expects {head}" + ("" if current == head else " (behind)"))
            return 0 if current == head else 1
    finally:
        engine.dispose()
    return 0


# ----------------------------------------------------------------------------- signing keys


def cmd_signing_key(args: argparse.Namespace) -> int:
    """``new PATH``: an Ed25519 private key written to PATH (mode 0600, never over an existing file);
    ``public PATH``: its public key. Either prints the public key (base64), what clients trust."""
    import os

    from service.bundle.signing import Signer, new_private_key

    if args.action == "new":
        pem, public = new_private_key()
        try:
            fd = os.open(args.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as err:
            raise UsageError(f"PATH: cannot create {args.path!r}: {err.strerror}") from None
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        print(public)
        print(f"signing key written to {args.path} (keep it secret); serve with FOLDWISE_SIGNING_KEY_FILE={args.path}; "
              "clients trust the public key above: KernelCache(..., trusted_keys=[...]) or FOLDWISE_TRUSTED_KEYS",
              file=sys.stderr)
        return 0
    try:
        with open(args.path, "rb") as f:
            print(Signer.from_pem(f.read(), where="PATH").public_key)
    except OSError as err:
        raise UsageError(f"PATH: cannot read {args.path!r}: {err.strerror}") from None
    except ValueError as err:
        raise UsageError(str(err)) from None
    return 0


# ----------------------------------------------------------------------------- tokens


def cmd_token(args: argparse.Namespace) -> int:
    from service import auth
    from service.store.db import session_factory

    settings = _settings(db_url=args.db)
    engine = _engine(settings.db_url)
    try:
        _current_or_exit(engine)
        with session_factory(engine)() as session:
            if args.action == "create":
                try:
                    token, secret = auth.create_token(session, args.name, args.scopes)
                except ValueError as err:
                    raise UsageError(f"--{'scopes' if 'scope' in str(err) else 'name'}: {err}") from None
                if args.json:
                    print(json.dumps({"id": token.id, "name": token.name, "scopes": token.scopes.split(),
                                      "token": secret}))
                else:
                    print(secret)
                    print(f"token {token.name!r} (id {token.id}, scopes {token.scopes}); the secret above is "
                          "shown only now: store it", file=sys.stderr)
            elif args.action == "revoke":
                if (args.name is None) == (args.id is None):
                    raise UsageError("token revoke: give --name or --id")
                revoked = auth.revoke_token(session, name=args.name, token_id=args.id)
                if not revoked:
                    which = f"name {args.name!r}" if args.name else f"id {args.id}"
                    raise UsageError(f"no active token with {which}")
                for t in revoked:
                    print(f"revoked token {t.name!r} (id {t.id})")
            else:
                rows = [{"id": t.id, "name": t.name, "scopes": t.scopes.split(),
                         "created_at": t.created_at.isoformat(), "revoked": t.revoked_at is not None,
                         "last_used_at": t.last_used_at.isoformat() if t.last_used_at else None}
                        for t in auth.list_tokens(session)]
                if args.json:
                    print(json.dumps(rows, indent=2))
                for r in rows if not args.json else []:
                    state = "revoked" if r["revoked"] else "active"
                    print(f"{r['id']}  {r['name']:<24} {','.join(r['scopes']):<28} {state}")
    finally:
        engine.dispose()
    return 0


# ----------------------------------------------------------------------------- worker


def cmd_worker_queue(args: argparse.Namespace) -> int:
    """``foldwise worker --db URL`` without ``--study``: take jobs from the service's queue."""
    from service.store.db import DatabaseBehind
    from service.logs import configure_logging
    from service.worker.tuning import SetupError, default_measurer
    from service.worker import run_worker

    settings = _settings(db_url=args.db, target=args.target, measurer=args.measurer)
    configure_logging(args.log_level)
    engine = _engine(settings.db_url)
    engine.dispose()
    stop = threading.Event()
    previous = _stop_on_signals(stop)
    measurer = settings.measurer or default_measurer()
    try:
        done = run_worker(settings.db_url, measurer=measurer, target=settings.target, worker_id=args.worker_id,
                          stop=stop, poll_s=args.poll, once=args.once, settings=settings)
    except SetupError as err:
        raise UsageError(err.cli_message) from None
    except DatabaseBehind as err:
        raise UsageError(str(err)) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.json:
        print(json.dumps({"jobs": done}))
    return 0


def _stop_on_signals(stop: threading.Event) -> dict[int, Any]:
    """SIGTERM/SIGINT: finish the current trial, give the job back, exit. Returns the handlers
    it replaced (to restore), or none when not on the main thread."""
    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():  # a second signal: leave now (the job's lease expires and it is taken over)
            raise SystemExit(128 + signum)
        stop.set()

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


# ----------------------------------------------------------------------------- serve


def cmd_serve(args: argparse.Namespace) -> int:
    """Migrate (SQLite) or check (shared database) the database, then run the API in N processes
    and the tuning workers in one process of their own (service/serve.py)."""
    from service import auth
    from service.store.db import session_factory, upgrade
    from service.logs import configure_logging
    from service.serve import serve
    from service.worker.tuning import default_measurer

    settings = _settings(db_url=args.db, host=args.host, port=args.port, workers=args.workers,
                         target=args.target, measurer=args.measurer)
    if args.processes < 1:
        raise UsageError(f"--processes: at least 1, got {args.processes}")
    targets = _targets(args.targets, settings.target)
    configure_logging(args.log_level)
    url = settings.db_url
    engine = _engine(url)
    try:
        if _is_sqlite(url):
            upgrade(url)  # a local file: serve creates and migrates it itself
        else:
            _current_or_exit(engine)  # a shared database is migrated on purpose: `foldwise db upgrade`
        with session_factory(engine)() as session:
            try:
                auth.check_bind_allowed(session, settings.host)
            except PermissionError as err:
                raise UsageError(str(err)) from None
    finally:
        engine.dispose()

    # picking the default looks for a GPU (imports torch): only when there are workers to run
    measurer = settings.measurer or (default_measurer() if settings.workers else "model")
    serve(settings, processes=args.processes, measurer=measurer, log_level=args.log_level, targets=targets)
    return 0


def _targets(text: str | None, default: str) -> list[str]:
    """``--targets h100,a100``: each checked (an unknown one exits 2 naming it), no repeats."""
    from service.errors import InvalidRequest
    from service.tuning_request import check_target

    names = [t.strip() for t in (text or default).split(",") if t.strip()]
    try:
        checked = [check_target(t) for t in names]
    except InvalidRequest as err:
        raise UsageError(f"--targets: {err.message}") from None
    return list(dict.fromkeys(checked)) or [default]


# ----------------------------------------------------------------------------- binaries


def cmd_binaries(args: argparse.Namespace) -> int:
    """``binaries backfill``: compile and store the binaries of kernels that have none."""
    from service.binaries import backfill
    from service.store.db import session_factory
    from tuner import shared_compile_pool

    settings = _settings(db_url=args.db)
    engine = _engine(settings.db_url)
    try:
        _current_or_exit(engine)

        def progress(sha: str, outcome: str, detail: str) -> None:
            print(f"{sha[:16]}  {outcome}  {detail}", flush=True)

        counts = backfill(session_factory(engine), limit=args.limit, pool=shared_compile_pool(), progress=progress)
    finally:
        engine.dispose()
    print(f"{counts['stored']} bundle(s) compiled and stored, {counts['failed']} failed")
    return 1 if counts["failed"] else 0


# ----------------------------------------------------------------------------- parsers


def add_service_commands(sub: Any) -> None:
    """Add ``serve``, ``db`` and ``token`` to the CLI's subparsers."""
    from service.logs import LEVELS
    from service.tuning_request import MEASURERS

    serve = sub.add_parser("serve", help="the REST API and dashboard, with tuning workers")
    serve.add_argument("--host", help="bind address (default 127.0.0.1; anything else needs API tokens)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--db", help="database URL (default: sqlite:///foldwise.db in the working directory, "
                                    "created and migrated by serve; a shared database must be migrated with "
                                    "`foldwise db upgrade`)")
    serve.add_argument("--processes", type=int, default=1,
                       help="HTTP processes sharing the port and the database (default 1; e.g. the number of "
                            "cores on a server)")
    serve.add_argument("--workers", type=int, help="tuning workers, run in one process apart from the HTTP "
                                                   "processes (default 1; 0: API only)")
    serve.add_argument("--measurer", choices=MEASURERS, help="the workers' measurer (default: cuda when a "
                                                             "GPU is visible, else model)")
    serve.add_argument("--target", help="the workers' target, and the default target of jobs (default h100)")
    serve.add_argument("--targets", help="comma-separated targets the tuning workers take jobs for, --workers "
                                         "of them for each (e.g. h100,a100; default: --target)")
    serve.add_argument("--log-level", default="info", choices=LEVELS)
    serve.set_defaults(func=cmd_serve)

    db = sub.add_parser("db", help="database migrations")
    db_sub = db.add_subparsers(dest="action", required=True)
    for action, text in (("upgrade", "apply the Alembic migrations (alembic upgrade head)"),
                         ("current", "print the database's revision; exit 1 when it is behind")):
        p = db_sub.add_parser(action, help=text)
        p.add_argument("--db", help="database URL (default: FOLDWISE_DB_URL, else sqlite:///foldwise.db)")
        p.set_defaults(func=cmd_db)

    binaries = sub.add_parser("binaries", help="compiled kernel binaries (cubins) in the kernel store")
    b_sub = binaries.add_subparsers(dest="action", required=True)
    fill = b_sub.add_parser("backfill", help="compile (no GPU needed) and store the binaries of stored kernels "
                                             "that have none, e.g. kernels stored before migration 0003")
    fill.add_argument("--db", help="database URL (default: FOLDWISE_DB_URL, else sqlite:///foldwise.db)")
    fill.add_argument("--limit", type=int, help="at most this many bundles (default: all)")
    fill.set_defaults(func=cmd_binaries)

    signing = sub.add_parser("signing-key", help="the key a server signs served bundles with (Ed25519)")
    k_sub = signing.add_subparsers(dest="action", required=True)
    for action, what in (("new", "make a private key at PATH (0600) and print its public key"),
                         ("public", "print the public key of the private key at PATH")):
        k = k_sub.add_parser(action, help=what)
        k.add_argument("path", metavar="PATH", help="the private key's file (PEM)")
        k.set_defaults(func=cmd_signing_key)

    token = sub.add_parser("token", help="API tokens (bearer tokens with scopes)")
    t_sub = token.add_subparsers(dest="action", required=True)
    create = t_sub.add_parser("create", help="create a token and print its secret (once)")
    create.add_argument("--name", required=True, help="who or what the token is for")
    create.add_argument("--scopes", required=True, help="comma-separated: jobs:write, kernels:read, admin")
    revoke = t_sub.add_parser("revoke", help="revoke tokens by name or id")
    revoke.add_argument("--name", help="revoke every active token with this name")
    revoke.add_argument("--id", help="revoke the token with this id")
    listing = t_sub.add_parser("list", help="list tokens (never their secrets)")
    for p in (create, revoke, listing):
        p.add_argument("--db", help="database URL (default: FOLDWISE_DB_URL, else sqlite:///foldwise.db)")
        p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(func=cmd_token)


def add_queue_worker_arguments(worker: argparse.ArgumentParser) -> None:
    """The ``worker`` command's job-queue flags (used when no ``--study`` is given)."""
    from service.logs import LEVELS

    worker.add_argument("--once", action="store_true", help="job-queue mode: process at most one job, then exit")
    worker.add_argument("--poll", type=float, default=1.0, metavar="SECONDS",
                        help="job-queue mode: how often to look for a job when idle (default 1)")
    worker.add_argument("--worker-id", help="job-queue mode: this worker's id (default: host-pid-random)")
    worker.add_argument("--log-level", default="info", choices=LEVELS, help="job-queue mode: JSON log level")
