"""The operator's coordinator process: `idletrain coordinator serve` (uvicorn, one process or a
supervised --processes N) and `idletrain coordinator migrate`."""

from __future__ import annotations

import argparse
import inspect
import os
import sys

from pydantic import ValidationError

from idletrain.cli.common import describe_validation, fail, log, without_server


def proxy_options(settings) -> dict:
    """uvicorn's X-Forwarded-For handling for `serve`: off unless the operator names the proxies
    (settings.forwarded_allow_ips). uvicorn's default believes the header from 127.0.0.1, so any
    request through loopback (a local process, a proxy passing it on) chose its own client address:
    200 registrations under spoofed addresses went past the per-address limit."""
    if not settings.forwarded_allow_ips:
        return {"proxy_headers": False}
    return {"proxy_headers": True, "forwarded_allow_ips": settings.forwarded_allow_ips}


def limit_options(settings) -> dict:
    """uvicorn's bounds for `serve` (both the one-process and the --processes N path): connections and
    requests in flight per process (settings.limit_concurrency; past it, 503), idle keep-alive
    (keep_alive_s), the size of a request's head with the h11 protocol, and the HTTP protocol itself:
    a ConnectionGuard (coordinator/connections.py), which bounds what each connection holds without
    a request (head_timeout_s, min_body_bytes_per_s after body_grace_s, max_connections_per_address).
    Bodies are bounded by the app itself too (max_json_bytes, max_upload_bytes and body_timeout_s:
    coordinator/limits.py, coordinator/api/uploads.py)."""
    from coordinator.connection_bounds import MAX_HEAD_BYTES, ConnectionLimits
    from coordinator.connections import ConnectionGuard

    return {"limit_concurrency": settings.limit_concurrency, "timeout_keep_alive": settings.keep_alive_s,
            "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
            "http": ConnectionGuard(ConnectionLimits.from_settings(settings))}


# descriptors a process holds besides its connections: the database pool, blobs read and written,
# the listening socket, the merger lock's connection, logs
SPARE_FILES = 256


def raise_open_files(connections: int) -> None:
    """Raise this process's soft limit on open files to its hard one (the --processes N inherit it): a
    coordinator out of descriptors accepts no connection, as down as one flooded. A log line says so
    when the limit stays below `connections` (limit_concurrency) plus SPARE_FILES."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return
    need = connections + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    target = max(soft, need) if hard == unlimited else hard  # macOS refuses an unlimited soft limit
    if soft != unlimited and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
    if soft != unlimited and soft < need:
        log.warning("open files are limited to %d per process, below the %d that limit_concurrency %d needs "
                    "(plus %d for the database and blobs): past it new connections wait. Raise the hard limit "
                    "(`ulimit -Hn`, LimitNOFILE= in a systemd unit) or lower IDLETRAIN_LIMIT_CONCURRENCY",
                    soft, need, connections, SPARE_FILES)


def cmd_coordinator_serve(args: argparse.Namespace) -> int:
    if (missing := without_server("idletrain coordinator serve")) is not None:
        return missing
    import uvicorn

    from coordinator.app import create_app
    from coordinator.db import driver_url
    from coordinator.settings import CoordinatorSettings
    from shared.extras import MissingExtra

    from coordinator import admin

    overrides = {k: v for k, v in {"host": args.host, "port": args.port, "data_dir": args.data_dir,
                                   "database_url": args.database_url, "admin_token": args.admin_token,
                                   "processes": args.processes, "forwarded_allow_ips": args.forwarded_allow_ips,
                                   "corpus_dirs": ",".join(args.corpus_dir) if args.corpus_dir else None,
                                   "allowed_hosts": ",".join(args.allowed_host) if args.allowed_host else None}.items()
                 if v is not None}
    try:
        settings = CoordinatorSettings(**overrides)
    except ValidationError as exc:
        return fail(describe_validation(exc))
    try:  # before any process starts: a driver missing would otherwise be a traceback in each of them
        driver_url(settings.resolved_database_url)
    except (MissingExtra, ValueError) as exc:
        return fail(str(exc))
    shared_db = settings.resolved_database_url.startswith("postgresql")
    if settings.processes > 1 and not shared_db:
        return fail("several coordinator processes need PostgreSQL (SQLite serves one process): pass "
                     "--database-url postgresql+psycopg://USER@HOST/DB")
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:  # here, once, before any process starts: the processes read the file this writes
        token, created = admin.ensure_token(settings.data_dir, settings.admin_token)
    except (OSError, ValueError) as exc:
        return fail(str(exc))
    if created:
        path = admin.token_path(settings.data_dir).resolve()
        print(f"idletrain: admin token (shown once; kept in {path}, mode 0600): {token}\n"
              f"idletrain: operator commands on this machine read it with --data-dir {settings.data_dir}; "
              "elsewhere pass --admin-token or set IDLETRAIN_ADMIN_TOKEN", file=sys.stderr)
    log.info("coordinator on http://%s:%d, data in %s, %d process(es)", settings.host, settings.port,
             settings.data_dir.resolve(), settings.processes)
    level, access = args.log_level.lower(), args.log_level.upper() == "DEBUG"
    raise_open_files(settings.limit_concurrency)
    if settings.processes == 1:
        settings = settings.model_copy(update={"relay": shared_db})  # other coordinators may join the database
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=level, access_log=access,
                    **proxy_options(settings), **limit_options(settings))
        return 0
    # uvicorn's supervisor starts the processes (and restarts one that dies); each builds its app
    # from the environment, so the settings travel as IDLETRAIN_* variables.
    for key, value in {**overrides, "data_dir": str(settings.data_dir.resolve()), "relay": "true"}.items():
        os.environ[f"IDLETRAIN_{key.upper()}"] = str(value)
    # uvicorn's supervisor kills a process that leaves its health ping unanswered for 5 s; a process
    # busy with a 124M model (creating a run, a snapshot, a checkpoint) can hold the GIL that long
    # on a loaded machine, and such a kill drops its requests mid-answer. Give it a minute.
    patient = ({"timeout_worker_healthcheck": 60}
               if "timeout_worker_healthcheck" in inspect.signature(uvicorn.run).parameters else {})
    uvicorn.run("coordinator.app:app_from_environment", factory=True, workers=settings.processes, host=settings.host,
                port=settings.port, log_level=level, access_log=access, **patient,
                **proxy_options(settings), **limit_options(settings))
    return 0


def cmd_coordinator_migrate(args: argparse.Namespace) -> int:
    if (missing := without_server("idletrain coordinator migrate")) is not None:
        return missing
    from coordinator import migrate
    from coordinator.db import make_engine
    from coordinator.settings import CoordinatorSettings
    from shared.extras import MissingExtra

    overrides = {k: v for k, v in {"data_dir": args.data_dir, "database_url": args.database_url}.items()
                 if v is not None}
    try:
        settings = CoordinatorSettings(**overrides)
    except ValidationError as exc:
        return fail(describe_validation(exc))
    try:
        engine = make_engine(settings.resolved_database_url)
    except (MissingExtra, ValueError) as exc:
        return fail(str(exc))
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        before = migrate.current(engine)
        if args.check:
            ok = before == migrate.head()
            print(f"database at {before or 'no schema'}, newest is {migrate.head()}: "
                  + ("up to date" if ok else "run `idletrain coordinator migrate`"))
            return 0 if ok else 1
        after = migrate.upgrade(engine)
    except Exception as exc:  # the driver's own errors: a wrong URL, a server that is down
        return fail(f"cannot migrate {engine.url.render_as_string(hide_password=True)}: {exc}")
    finally:
        engine.dispose()
    print(f"database {engine.url.render_as_string(hide_password=True)}: {before or 'empty'} -> {after}")
    return 0


def register(sub) -> None:
    """`idletrain coordinator serve|migrate`."""
    coord = sub.add_parser("coordinator", help="run the coordinator").add_subparsers(dest="action", required=True)
    serve = coord.add_parser("serve", help="serve the HTTP API and merge deltas")
    serve.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8000)")
    serve.add_argument("--data-dir", default=None, help="blobs and the SQLite database (default ./idletrain-data)")
    serve.add_argument("--database-url", default=None, help="SQLAlchemy URL (default: SQLite in the data dir)")
    serve.add_argument("--admin-token", default=None, help="token operator actions require (default: the one in "
                                                           "DATA_DIR/admin_token, generated on first start)")
    serve.add_argument("--corpus-dir", action="append", default=None, metavar="DIR",
                       help="a folder run corpora may come from, besides DATA_DIR/corpora (repeatable)")
    serve.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                       help="a Host name to answer besides the loopback names and --host, e.g. the public name "
                            "behind a reverse proxy (repeatable; *.example.org for subdomains)")
    serve.add_argument("--processes", type=int, default=None,
                       help="HTTP processes on one port (PostgreSQL only): all answer workers, one at a time "
                            "merges (the holder of the merger lock; another takes over when it dies)")
    serve.add_argument("--forwarded-allow-ips", default=None,
                       help="comma-separated addresses of reverse proxies whose X-Forwarded-For is believed "
                            "(e.g. 127.0.0.1 for nginx on this machine); default: none")
    serve.set_defaults(func=cmd_coordinator_serve)
    mig = coord.add_parser("migrate", help="bring the database schema to the newest version (serve does it too)")
    mig.add_argument("--data-dir", default=None, help="where the SQLite database lives (default ./idletrain-data)")
    mig.add_argument("--database-url", default=None, help="SQLAlchemy URL (default: SQLite in the data dir)")
    mig.add_argument("--check", action="store_true", help="only say whether it is up to date (exit 1 if not)")
    mig.set_defaults(func=cmd_coordinator_migrate)
