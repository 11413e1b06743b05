"""The one HTTP client of the operator's commands: the coordinator's base URL (--coordinator), the
admin token (--admin-token, IDLETRAIN_ADMIN_TOKEN, or the coordinator's own token file), and one
way to say what went wrong. Each call answers (0, what came back) or (exit code, None) after
printing why, so a command returns the code as it is."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import httpx

from idletrain.cli.common import fail


def error_detail(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail")
    except ValueError:
        return resp.text
    return detail if isinstance(detail, str) else json.dumps(detail)


class OperatorClient:
    """Built from a command's parsed arguments: `coordinator`, and where present `admin_token` and
    `data_dir` (the token is looked up only when a request needs it)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.base = args.coordinator
        self.admin_token = getattr(args, "admin_token", None)
        self.data_dir = getattr(args, "data_dir", None)

    def _data_dir(self) -> Path:
        return Path(self.data_dir or os.environ.get("IDLETRAIN_DATA_DIR") or "./idletrain-data")

    def token(self) -> str | None:
        """The operator's token: --admin-token, else IDLETRAIN_ADMIN_TOKEN, else the coordinator's own
        token file in --data-dir (default: IDLETRAIN_DATA_DIR, else ./idletrain-data) when this machine
        has it, so the operator next to the coordinator types nothing. None when none is found;
        ValueError for a token file open to others, or empty."""
        from coordinator import admin

        token = self.admin_token or os.environ.get("IDLETRAIN_ADMIN_TOKEN")
        if token:
            return token
        return admin.read_token(admin.token_path(self._data_dir()))

    def hint(self) -> str:
        return (f"operator commands need the coordinator's admin token: pass --admin-token, set "
                f"IDLETRAIN_ADMIN_TOKEN, or run this on the coordinator's machine with --data-dir pointing at its "
                f"data dir (looked in {self._data_dir() / 'admin_token'})")

    def _headers(self) -> tuple[int, dict]:
        try:
            token = self.token()
        except ValueError as exc:  # a token file open to others, or empty
            return fail(str(exc)), {}
        return 0, {"Authorization": f"Bearer {token}"} if token else {}

    def _unreachable(self, exc: httpx.TransportError) -> int:
        return fail(f"cannot reach the coordinator at {self.base} ({exc}); is it running?")

    def call(self, method: str, path: str, *, admin: bool = False, json: dict | None = None,
             params: dict | None = None) -> tuple[int, object]:
        """One request to /api/v1{path} (with a `json` body, query `params`); with `admin`, carrying the
        operator's token."""
        headers: dict = {}
        if admin:
            rc, headers = self._headers()
            if rc:
                return rc, None
        try:
            extra = {k: v for k, v in (("json", json), ("params", params)) if v is not None}
            resp = httpx.request(method, f"{self.base}/api/v1{path}", timeout=60, headers=headers, **extra)
        except httpx.TransportError as exc:
            return self._unreachable(exc), None
        if resp.status_code in (401, 403) and admin:
            return fail(f"{resp.status_code}: {error_detail(resp)}; {self.hint()}"), None
        if resp.status_code >= 400:
            return fail(f"{resp.status_code}: {error_detail(resp)}"), None
        return 0, resp.json()

    def create_run(self, config: dict) -> tuple[int, object]:
        """POST /runs with the operator's token (creating a run builds its model: a long timeout)."""
        rc, headers = self._headers()
        if rc:
            return rc, None
        try:
            resp = httpx.post(f"{self.base}/api/v1/runs", json=config, headers=headers, timeout=600)
        except httpx.TransportError as exc:
            return self._unreachable(exc), None
        if resp.status_code in (401, 403):
            return fail(f"coordinator refused the run ({resp.status_code}: {error_detail(resp)}); {self.hint()}"), None
        if resp.status_code != 201:
            return fail(f"coordinator refused the run ({resp.status_code}): {error_detail(resp)}"), None
        return 0, resp.json()

    def snapshot(self, run: str, version: str) -> tuple[int, httpx.Response | None]:
        """GET a run's snapshot (public: no token); the answer, its bytes not yet checked."""
        try:
            resp = httpx.get(f"{self.base}/api/v1/runs/{run}/snapshots/{version}", timeout=600)
        except httpx.TransportError as exc:
            return self._unreachable(exc), None
        if resp.status_code != 200:
            return fail(f"{resp.status_code}: {error_detail(resp)}"), None
        return 0, resp
