"""Durable file writes, for the coordinator's blobs and checkpoints and the worker's local state."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path


SYNC_CHUNK = 32 << 20  # a large file is written and synced this much at a time


def umask() -> int:
    """The process's umask (read by setting it and back: there is no other portable way)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_mode() -> int:
    """The mode a plain open() gives a new file: 0666 less the umask."""
    return 0o666 & ~umask()


def readable(path: Path) -> None:
    """Give a file plain_mode(): a temp file (mkstemp) and safetensors' save_file make 0600, which
    other users of a shared folder cannot read."""
    os.chmod(path, plain_mode())


def atomic_write(path: Path, data: bytes | memoryview | Sequence[bytes | memoryview], *,
                 shared: bool = False) -> None:
    """Temp file, fsync, rename, fsync of the folder: a crash leaves the old file or the new one.
    The file is private (0600, as its temp file is made) unless `shared` (the mode a plain open()
    gives: a dataset's or an export's files, read by others).

    `data` is one buffer or several written back to back (a large file in parts, so it is never
    joined into one more copy: joining holds the GIL for the whole copy). A
    large file (a 124M model's snapshot is ~460 MB, its checkpoint ~1.5 GB) is synced every
    SYNC_CHUNK bytes as it is written: the kernel then never holds gigabytes of it unwritten, which
    every other fsync on the disk (each acknowledged delta's) would otherwise wait behind."""
    parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if shared:
            os.fchmod(fd, plain_mode())
        with os.fdopen(fd, "wb", buffering=0) as f:
            unsynced = 0
            for part in parts:
                view = memoryview(part).cast("B")
                for start in range(0, len(view), SYNC_CHUNK):
                    piece = view[start:start + SYNC_CHUNK]
                    while piece:  # a raw write may take less than it was given
                        piece = piece[f.write(piece):]
                    unsynced += min(SYNC_CHUNK, len(view) - start)
                    if unsynced >= SYNC_CHUNK:
                        os.fdatasync(f.fileno()) if hasattr(os, "fdatasync") else os.fsync(f.fileno())
                        unsynced = 0
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_dir(path.parent)


def make_dirs(folder: Path) -> None:
    """`mkdir -p`, durably: each folder it creates has its parent synced after, so the new folder's
    entry (and with it every file later synced into it) survives a crash."""
    folder = Path(folder)
    missing = []
    while not folder.is_dir():
        missing.append(folder)
        if folder.parent == folder:
            break
        folder = folder.parent
    for new in reversed(missing):
        try:
            new.mkdir()
        except FileExistsError:  # made meanwhile by another thread; sync anyway: its sync may not be done
            if not new.is_dir():
                raise
        sync_dir(new.parent)


def sync_dir(folder: Path) -> None:
    """fsync a folder, so a rename or a new file in it survives a crash. Errors surface: a rename
    not known to be durable must not be acknowledged as if it were."""
    if os.name == "nt":  # Windows cannot open a folder; NTFS journals the rename itself
        return
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    except OSError as exc:
        # Some filesystems cannot fsync a folder at all (EINVAL: older CIFS/SMB and some FUSE mounts):
        # nothing more can be done there, and failing every write would make the data dir unusable.
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(dir_fd)
