"""What every audience's commands share: the one way to fail (a line on stderr, exit 2), the logging
set-up, the check that the server extra is installed, and the help texts of the operator's token options."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

from pydantic import ValidationError

from shared.extras import MissingExtra, require

log = logging.getLogger("idletrain")

ADMIN_TOKEN_HELP = "default: $IDLETRAIN_ADMIN_TOKEN, else the token file in --data-dir"
DATA_DIR_HELP = ("the coordinator's data dir, where `serve` keeps admin_token (default: $IDLETRAIN_DATA_DIR, else "
                 "./idletrain-data)")
DEFAULT_COORDINATOR = "http://127.0.0.1:8000"
# What the coordinator imports that a worker-only install (the package without extras) lacks; numba,
# also in the extra, is optional even there (shared/kernels.py has numpy twins).
SERVER_MODULES = ("fastapi", "uvicorn", "sqlalchemy", "alembic", "prometheus_client")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # One line per HTTP request drowns the worker's own progress lines.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, getattr(logging, level.upper())))
    logging.getLogger("alembic").setLevel(max(logging.WARNING, getattr(logging, level.upper())))


def fail(msg: str) -> int:
    print(f"idletrain: {msg}", file=sys.stderr)
    return 2


def without_server(command: str) -> int | None:
    """None when the server extra is installed; else the exit code of `fail` with one line naming
    `pip install 'idletrain[server]'` (for `command`, e.g. "idletrain coordinator serve")."""
    for module in SERVER_MODULES:
        try:
            require(module, "server", purpose=f"`{command}`")
        except MissingExtra as exc:
            return fail(f"{exc} (a worker-only install has no coordinator)")
    return None


def describe_validation(exc: ValidationError) -> str:
    """A pydantic error as one line: `field.path: message; ...`."""
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())


TICK_S = 15.0  # a long wait says it is still waiting this often


@contextlib.contextmanager
def ticking(doing: str, *, every_s: float | None = None) -> Iterator[None]:
    """Say on stderr what a long call does, that it still does it every `every_s` seconds, and how
    long it took: a command that waits minutes in silence looks hung."""
    every_s = TICK_S if every_s is None else every_s
    print(f"{doing} ...", file=sys.stderr, flush=True)
    t0, stop = time.monotonic(), threading.Event()

    def tick() -> None:
        while not stop.wait(every_s):
            print(f"  ... still at it ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    ticker = threading.Thread(target=tick, name="idletrain-ticking", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        print(f"  ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
