"""Blobs in the data dir: shards, snapshots, received deltas, checkpoints. Writes are atomic
(temp file, fsync, rename, fsync of the folder), so a crash leaves either the old file or the new.
Deltas that every kept checkpoint already holds are deleted unless the operator keeps them
(`keep_deltas`; Coordinator.prune_history)."""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

from shared.files import atomic_write, make_dirs, sync_dir


PRUNED_MARK = "pruned-through"  # in a run's deltas folder: deltas up to this version were deleted


@dataclasses.dataclass(frozen=True)
class ReceivedBody:
    """An upload's body as the route streamed it to `path` (Storage.receiving: not durable yet), with
    its sha256 taken while it arrived; len() is its size in bytes, as for the bytes themselves."""

    path: Path
    sha256: str
    size: int

    def __len__(self) -> int:
        return self.size

    def read(self) -> bytes:
        return self.path.read_bytes()


class Storage:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        make_dirs(self.root)  # nothing written when it exists: a start on a full disk gets past this

    def run_dir(self, run_id: int) -> Path:
        return self.root / "runs" / str(run_id)

    def shard(self, run_id: int, index: int) -> Path:
        return self.run_dir(run_id) / "shards" / f"{index:06d}.zst"

    def eval_tokens(self, run_id: int) -> Path:
        return self.run_dir(run_id) / "eval.bin"

    def snapshot(self, run_id: int, version: int) -> Path:
        return self.run_dir(run_id) / "snapshots" / f"{version:010d}.safetensors.zst"

    def update(self, run_id: int, from_version: int, to_version: int) -> Path:
        """The int8 change between two versions (shared/algorithms/sync.py), built on first request."""
        return self.run_dir(run_id) / "updates" / f"{from_version:010d}-{to_version:010d}.delta"

    def deltas(self, run_id: int) -> Path:
        """The folder of a run's received deltas: one file per sequence number (`<seq>.delta`), the
        staged files of uploads not merged yet (`staged_delta`) and the prune mark (PRUNED_MARK)."""
        return self.run_dir(run_id) / "deltas"

    def delta(self, run_id: int, seq: int) -> Path:
        return self.deltas(run_id) / f"{seq:010d}.delta"

    def staged_delta(self, run_id: int, lease_id: int, sha256: str) -> Path:
        """Where an upload writes its bytes, durably, before it takes a sequence number: named by its
        lease and content, so the serial part of an acknowledgement holds no file operation. The
        merger (or a restart's replay) renames it to its sequence number with `adopt_delta`."""
        return self.deltas(run_id) / f"lease-{lease_id:010d}-{sha256[:32]}.staged"

    def staged_deltas(self, run_id: int) -> Iterator[tuple[Path, int, str]]:
        """Every staged delta file of the run: (path, lease id, the start of its content's sha256)."""
        for path in self.deltas(run_id).glob("lease-*.staged"):
            _, lease_part, sha_part = (path.stem.split("-") + ["", ""])[:3]
            if lease_part.isdigit() and sha_part:
                yield path, int(lease_part), sha_part

    def receiving(self, run_id: int, lease_id: int) -> Path:
        """A fresh name for an upload's bytes while they arrive (`.lease-<id>-<random>.part`, in the
        deltas folder so `stage_received` is a rename): never adopted or replayed, deleted when its
        upload is refused, and when a crash left it behind (`partial_uploads`)."""
        folder = self.deltas(run_id)
        make_dirs(folder)  # a new folder's entry synced into its parent: the staged file lives on in it
        return folder / f".lease-{lease_id:010d}-{secrets.token_hex(8)}.part"

    def partial_uploads(self, run_id: int) -> Iterator[Path]:
        return self.deltas(run_id).glob(".lease-*.part")

    def stage_received(self, received: ReceivedBody, staged: Path) -> None:
        """Make a streamed upload durable under its staged name: fsync, rename, fsync of the folder (what
        `write` does, without the body ever being in memory)."""
        with open(received.path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(received.path, staged)
        sync_dir(staged.parent)

    def adopt_delta(self, run_id: int, seq: int, lease_id: int, sha256: str) -> Path:
        """The file of delta `seq`, renamed from its staged name if it is not there yet (a rename
        and a sync of the folder: atomic, so a crash leaves one name or the other)."""
        path = self.delta(run_id, seq)
        if not path.exists():
            staged = self.staged_delta(run_id, lease_id, sha256)
            if staged.exists():
                os.replace(staged, path)
                sync_dir(path.parent)
        return path

    def pruned_through(self, run_id: int) -> int:
        """The version up to which this run's received deltas (and exchange bodies) were deleted; 0: none."""
        try:
            return int((self.deltas(run_id) / PRUNED_MARK).read_text())
        except FileNotFoundError:
            return 0

    def prune_deltas(self, run_id: int, through: int) -> int:
        """Delete the delta files of sequence numbers up to `through`; returns how many went. The mark
        is written first, so a crash in between leaves files behind, never a gap nobody knows about."""
        self.write(self.deltas(run_id) / PRUNED_MARK, str(int(through)).encode())
        gone = 0
        for path in self.deltas(run_id).glob("*.delta"):
            if path.stem.isdigit() and int(path.stem) <= through:
                path.unlink(missing_ok=True)
                gone += 1
        return gone

    def checkpoints(self, run_id: int) -> Path:
        """The folder of a run's checkpoints, one file per version: `<version>.ckpt`."""
        return self.run_dir(run_id) / "checkpoints"

    def checkpoint(self, run_id: int, version: int) -> Path:
        return self.checkpoints(run_id) / f"{version:010d}.ckpt"

    def list_checkpoints(self, run_id: int) -> list[tuple[int, Path]]:
        """(version, path), newest first."""
        found = []
        for path in self.checkpoints(run_id).glob("*.ckpt"):
            if path.stem.isdigit():
                found.append((int(path.stem), path))
        return sorted(found, reverse=True)

    def write(self, path: Path, data: bytes | Sequence[bytes | memoryview]) -> None:
        """Atomically, durably: one buffer, or parts written back to back (never joined in memory)."""
        atomic_write(path, data)

    def read(self, path: Path) -> bytes:
        return path.read_bytes()
