"""Small stores under the worker's state dir: its credentials per (coordinator, run), and the shards
and tokenizers it downloaded, by content hash."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

from shared import protocol

log = logging.getLogger(__name__)


class TokenStore:
    """Worker credentials per (coordinator, run), in a 0600 JSON file under the state dir."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "tokens.json"

    def _load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def get(self, coordinator: str, run: str) -> str | None:
        entry = self._load().get(f"{coordinator}|{run}")
        return entry.get("token") if isinstance(entry, dict) else None

    def put(self, coordinator: str, run: str, worker_id: int, token: str) -> None:
        data = self._load()
        data[f"{coordinator}|{run}"] = {"worker_id": worker_id, "token": token}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, self.path)


_SHA256 = re.compile(protocol.SHA256_PATTERN)


class ShardCache:
    """Shards on disk by content hash: a shard is downloaded once per machine.

    The hash comes from the coordinator, which is not trusted: a file name is made only of a
    64-character lowercase hex digest (anything else is refused before any path is built), the
    path must stay under the cache's folder, and a hit is hashed again before use (a file that
    rotted or was replaced is deleted and the shard fetched anew, never trained on)."""

    def __init__(self, root: Path, max_files: int = 256, *, folder: str = "shards", suffix: str = ".bin") -> None:
        self.root = root / folder
        self.max_files, self.suffix = max_files, suffix

    @classmethod
    def tokenizers(cls, root: Path) -> ShardCache:
        """The same store for runs' tokenizer.json files (`tokenizers/<sha256>.json`)."""
        return cls(root, 16, folder="tokenizers", suffix=".json")

    def path(self, sha: str) -> Path:
        """The file of shard `sha`; ValueError when `sha` is not a digest (an absolute path, '../x')."""
        if not isinstance(sha, str) or _SHA256.fullmatch(sha) is None:
            raise ValueError(f"shard hash {str(sha)[:80]!r} is not 64 lowercase hex characters")
        path = self.root / f"{sha}{self.suffix}"
        if path.parent.resolve() != self.root.resolve():  # a symlinked file name cannot be made of hex
            raise ValueError(f"shard file {path} is outside the cache {self.root}")
        return path

    def get(self, sha: str) -> bytes | None:
        path = self.path(sha)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        if hashlib.sha256(raw).hexdigest() != sha:
            log.warning("cached file %s fails its SHA-256 (corrupted or replaced); deleting it and fetching "
                        "it again", path.name)
            path.unlink(missing_ok=True)
            return None
        return raw

    def put(self, sha: str, raw: bytes) -> None:
        path = self.path(sha)
        self.root.mkdir(parents=True, exist_ok=True)
        files = sorted(self.root.glob(f"*{self.suffix}"), key=lambda p: p.stat().st_mtime)
        for old in files[: max(0, len(files) - self.max_files + 1)]:
            old.unlink(missing_ok=True)
        tmp = self.root / f".{sha}.tmp"
        tmp.write_bytes(raw)
        os.replace(tmp, path)
