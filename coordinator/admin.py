"""The operator's admin token: always required by the operator routes (coordinator/api/deps.py).

Given as IDLETRAIN_ADMIN_TOKEN / --admin-token, or else kept in `<data_dir>/admin_token` (mode 0600),
which the coordinator writes on its first start. The operator's commands on the coordinator's
machine read that file themselves (idletrain/cli.py), so nobody types the token there. There is no
open mode: with one, anything that reached loopback (a browser page's cross-origin POST, a DNS
rebinding, a reverse proxy on the same machine) could act as the operator.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from shared.errors import ConfigError

log = logging.getLogger(__name__)

TOKEN_FILE = "admin_token"
MIN_LENGTH = 16  # as CoordinatorSettings.admin_token
_TOKEN_BYTES = 32  # secrets.token_urlsafe(32): 43 characters, 256 bits


def token_path(data_dir: Path) -> Path:
    return Path(data_dir) / TOKEN_FILE


def read_token(path: Path) -> str | None:
    """The token kept in `path`, None when there is no such file; refuses a file that group or
    others may read (the token in it is as good as published) or that holds no usable token."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the admin token file {path} is open to group or others (mode "
                          f"{stat.S_IMODE(st.st_mode):o}): run `chmod 600 {path}` (or delete it to have a new "
                          "token generated)")
    token = path.read_text(encoding="utf-8").strip()
    if len(token) < MIN_LENGTH:
        raise ConfigError(f"the admin token file {path} holds no token of {MIN_LENGTH}+ characters: delete it to "
                          "have a new one generated, or write one there (mode 0600)")
    return token


def ensure_token(data_dir: Path, given: str | None = None) -> tuple[str, bool]:
    """(the admin token, whether it was generated just now). `given` (the settings' admin_token)
    wins; else the token file's, written first if there is none. Several coordinator processes may
    start at once: the first to link its file into place wins, and the others read that one."""
    if given is not None:
        return given, False
    path = token_path(data_dir)
    found = read_token(path)
    if found is not None:
        return found, False
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written whole under a private name, then linked into place: a process that finds the file
    # never reads it half-written, and link() fails when another process got there first.
    tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secrets.token_urlsafe(_TOKEN_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            created = True
        except FileExistsError:  # another coordinator process wrote it first: use theirs
            created = False
    finally:
        tmp.unlink(missing_ok=True)
    token = read_token(path)
    if token is None:
        raise ConfigError(f"the admin token file {path} vanished just after it was written; start again")
    if not created:
        return token, False
    log.warning("admin token generated and written to %s (mode 0600); operator commands on this machine read it "
                "from there (`--data-dir`), elsewhere pass it as --admin-token or IDLETRAIN_ADMIN_TOKEN", path)
    return token, True
