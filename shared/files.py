"""Durable file writes, for the coordinator's blobs and checkpoints and the worker's local state."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


SYNC_CHUNK = 32 << 20  # a large file is written and synced this much at a time


def atomic_write(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename, fsync of the folder: a crash leaves the old file or the new one.

    A large file (a 124M model's snapshot is ~460 MB, its checkpoint ~1.5 GB) is synced every
    SYNC_CHUNK bytes as it is written: the kernel then never holds gigabytes of it unwritten, which
    every other fsync on the disk (each acknowledged delta's) would otherwise wait behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            view = memoryview(data)
            for start in range(0, len(view), SYNC_CHUNK):
                f.write(view[start:start + SYNC_CHUNK])
                if start + SYNC_CHUNK < len(view):
                    f.flush()
                    os.fdatasync(f.fileno()) if hasattr(os, "fdatasync") else os.fsync(f.fileno())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # not every platform can open a folder (Windows); the rename is durable enough there
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
