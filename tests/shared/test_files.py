"""shared/files.py atomic_write: the whole content or the old file; a large file synced as it goes."""

from __future__ import annotations

import os

import pytest

from shared import files


def test_writes_replace_the_whole_file(tmp_path):
    path = tmp_path / "a" / "blob"
    files.atomic_write(path, b"old")
    files.atomic_write(path, b"new content")
    assert path.read_bytes() == b"new content"
    assert [p.name for p in path.parent.iterdir()] == ["blob"]  # no temp file left behind


def test_a_large_file_is_synced_chunk_by_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "SYNC_CHUNK", 1000)
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd))[1])
    data = bytes(range(256)) * 20  # 5,120 bytes: 6 chunks, 5 synced on the way, the last by fsync
    files.atomic_write(tmp_path / "big", data)
    assert (tmp_path / "big").read_bytes() == data
    assert synced == [1000, 2000, 3000, 4000, 5000]


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "blob"
    files.atomic_write(path, b"old")

    def broken(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError):
        files.atomic_write(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["blob"]


def test_parts_are_written_back_to_back_and_synced_as_they_add_up(tmp_path, monkeypatch):
    import numpy as np

    monkeypatch.setattr(files, "SYNC_CHUNK", 1000)
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd))[1])
    arr = np.arange(300, dtype=np.float32)  # 1,200 bytes, handed over as a typed memoryview
    parts = [b"head", memoryview(arr), bytearray(b"x" * 800), b""]
    files.atomic_write(tmp_path / "parts", parts)
    assert (tmp_path / "parts").read_bytes() == b"head" + arr.tobytes() + b"x" * 800
    assert synced == [1004, 2004]  # a sync whenever 1,000 unsynced bytes have gathered, across parts


def _fsync_of_folders_fails(monkeypatch, err: int) -> None:
    import stat

    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(err, os.strerror(err))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_folder_sync_that_fails_is_an_error_not_a_success(tmp_path, monkeypatch):
    """An I/O error syncing the folder means the rename may not survive a crash: the write must not
    look done (it was swallowed, and an upload acknowledged on it)."""
    import errno

    _fsync_of_folders_fails(monkeypatch, errno.EIO)
    with pytest.raises(OSError, match="Input/output error"):
        files.sync_dir(tmp_path)
    with pytest.raises(OSError, match="Input/output error"):
        files.atomic_write(tmp_path / "blob", b"data")


def test_a_filesystem_that_cannot_sync_folders_is_tolerated(tmp_path, monkeypatch):
    import errno

    _fsync_of_folders_fails(monkeypatch, errno.EINVAL)  # some CIFS and FUSE mounts: nothing more to do
    files.atomic_write(tmp_path / "blob", b"data")
    assert (tmp_path / "blob").read_bytes() == b"data"


def test_a_folder_that_cannot_be_opened_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.sync_dir(tmp_path / "missing")


def test_new_folders_have_their_parents_synced(tmp_path, monkeypatch):
    """Writing into a/b/c creates three folders: each one's entry is synced into its parent (else a
    crash can lose the folder, and the fsynced file in it with it), and c itself for the file."""
    synced = []
    real = files.sync_dir
    monkeypatch.setattr(files, "sync_dir", lambda folder: (synced.append(folder), real(folder))[1])
    files.atomic_write(tmp_path / "a" / "b" / "c" / "blob", b"data")
    assert synced == [tmp_path, tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    synced.clear()
    files.atomic_write(tmp_path / "a" / "b" / "c" / "other", b"data")  # nothing new: only the file's folder
    assert synced == [tmp_path / "a" / "b" / "c"]
