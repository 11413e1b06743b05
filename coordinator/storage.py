"""Blobs in the data dir: shards, the eval split, the tokenizer, snapshots, model updates, received deltas, checkpoints.

    BlobStore    what the coordinator needs of a place for named blobs ("runs/3/deltas/0000000012.delta"):
                 read / write / delete / list, and exists, move and modified_at; the seam an object
                 store plugs into
    LocalBlobs   the local filesystem's: files under one folder, each write atomic (temp file, fsync,
                 rename, fsync of the folder), so a crash leaves either the old blob or the new
    Storage      a run's blobs by name, and what the coordinator does with them: stage and adopt
                 received deltas, prune them, list checkpoints and model updates

Callers name blobs through Storage and never see a path, with one documented escape hatch: an
upload's body streams to a local file as it arrives (Storage.receiving gives the Path; the body is
never whole in memory) and becomes a blob by a rename (BlobStore.adopt_file). Deltas that every
kept checkpoint already holds are deleted unless the operator keeps them (`keep_deltas`;
RecoveryService.prune_history).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from shared.files import atomic_write, make_dirs, sync_dir

PRUNED_MARK = "pruned-through"  # in a run's deltas folder: deltas up to this version were deleted
Data = bytes | memoryview | Sequence[bytes | memoryview]


class BlobStore(Protocol):
    """Named blobs. A missing blob raises FileNotFoundError on read, move and modified_at."""

    def read(self, name: str) -> bytes: ...

    def write(self, name: str, data: Data) -> None:
        """Atomically and durably: one buffer, or parts written back to back (never joined in memory)."""

    def delete(self, name: str) -> bool:
        """True when it was there."""

    def list(self, folder: str) -> list[str]:
        """The names of the blobs directly in `folder` (sorted; [] when there is none)."""

    def exists(self, name: str) -> bool: ...

    def move(self, src: str, dst: str) -> None:
        """Rename, atomically and durably: a crash leaves one name or the other."""

    def modified_at(self, name: str) -> float:
        """When the blob was last written (seconds since the epoch)."""

    # the local-file escape hatch (streamed uploads)
    def local_path(self, name: str) -> Path:
        """A local file to write this blob's bytes into as they arrive (not durable, not a blob yet)."""

    def adopt_file(self, path: Path, name: str) -> None:
        """Make a file from local_path the blob `name`, durably (what write does, without its bytes in memory)."""


class LocalBlobs:
    """BlobStore on the local filesystem: each name is a file under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        make_dirs(self.root)  # nothing written when it exists: a start on a full disk gets past this

    def _path(self, name: str) -> Path:
        return self.root / name

    def read(self, name: str) -> bytes:
        return self._path(name).read_bytes()

    def write(self, name: str, data: Data) -> None:
        atomic_write(self._path(name), data)

    def delete(self, name: str) -> bool:
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            return False
        return True

    def list(self, folder: str) -> list[str]:
        try:
            with os.scandir(self._path(folder)) as entries:
                return sorted(f"{folder}/{e.name}" for e in entries if e.is_file())
        except FileNotFoundError:
            return []

    def exists(self, name: str) -> bool:
        return self._path(name).exists()

    def move(self, src: str, dst: str) -> None:
        target = self._path(dst)
        os.replace(self._path(src), target)
        sync_dir(target.parent)

    def modified_at(self, name: str) -> float:
        return self._path(name).stat().st_mtime

    def local_path(self, name: str) -> Path:
        path = self._path(name)
        make_dirs(path.parent)  # a new folder's entry synced into its parent: the blob lives on in it
        return path

    def adopt_file(self, path: Path, name: str) -> None:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        target = self._path(name)
        os.replace(path, target)
        sync_dir(target.parent)


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


def _stem(name: str) -> str:
    """A blob's own name without its folder or its last suffix: "runs/1/deltas/0000000012.delta" -> "0000000012"."""
    return name.rsplit("/", 1)[-1].rsplit(".", 1)[0]


def _base(name: str) -> str:
    return name.rsplit("/", 1)[-1]


class Storage:
    """A run's blobs by name on a BlobStore (`blobs`), and the operations on them."""

    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs

    @classmethod
    def local(cls, root: Path) -> Storage:
        return cls(LocalBlobs(root))

    # -- the blobs --------------------------------------------------------------------------------

    def read(self, name: str) -> bytes:
        return self.blobs.read(name)

    def write(self, name: str, data: Data) -> None:
        """Atomically, durably: one buffer, or parts written back to back (never joined in memory)."""
        self.blobs.write(name, data)

    def delete(self, name: str) -> bool:
        return self.blobs.delete(name)

    def exists(self, name: str) -> bool:
        return self.blobs.exists(name)

    def list(self, folder: str) -> list[str]:
        return self.blobs.list(folder)

    def modified_at(self, name: str) -> float:
        return self.blobs.modified_at(name)

    # -- names ------------------------------------------------------------------------------------

    @staticmethod
    def run_dir(run_id: int) -> str:
        return f"runs/{run_id}"

    def shard(self, run_id: int, index: int) -> str:
        return f"{self.run_dir(run_id)}/shards/{index:06d}.zst"

    def eval_tokens(self, run_id: int) -> str:
        return f"{self.run_dir(run_id)}/eval.bin"

    def tokenizer(self, run_id: int) -> str:
        """The run's tokenizer.json (shared/tokenizer.py), served as is; none for runs from before tokenizers
        (they are the bytes tokenizer's)."""
        return f"{self.run_dir(run_id)}/tokenizer.json"

    def snapshot(self, run_id: int, version: int) -> str:
        return f"{self.run_dir(run_id)}/snapshots/{version:010d}.safetensors.zst"

    def updates(self, run_id: int) -> str:
        """The folder of a run's model updates: one per (from, to) pair, `<from>-<to>.delta`."""
        return f"{self.run_dir(run_id)}/updates"

    def update(self, run_id: int, from_version: int, to_version: int) -> str:
        """The int8 change between two versions (shared/algorithms/sync.py), built on first request."""
        return f"{self.updates(run_id)}/{from_version:010d}-{to_version:010d}.delta"

    def copies(self, run_id: int) -> str:
        """The folder of the workers' model copies of a run with update_feedback: `<sha256>.f32`, each
        copy's tensors in name order as little-endian float32, named by sync.copy_digest, and the updates
        built from them (copy_update)."""
        return f"{self.run_dir(run_id)}/copies"

    def copy(self, run_id: int, digest: str) -> str:
        return f"{self.copies(run_id)}/{digest}.f32"

    def copy_update(self, run_id: int, digest: str, to_version: int) -> str:
        """The update from the copy `digest` to `to_version`, kept beside the copy (and deleted with it)."""
        return f"{self.copies(run_id)}/{digest}.{to_version:010d}.delta"

    def deltas(self, run_id: int) -> str:
        """The folder of a run's received deltas: one per sequence number (`<seq>.delta`), the staged
        ones of uploads not merged yet (`staged_delta`) and the prune mark (PRUNED_MARK)."""
        return f"{self.run_dir(run_id)}/deltas"

    def delta(self, run_id: int, seq: int) -> str:
        return f"{self.deltas(run_id)}/{seq:010d}.delta"

    def compensation(self, run_id: int, seq: int) -> str:
        """The bytes of delta `seq`, kept after a failed spot-check until the checkpoints hold its
        compensation (coordinator/queries/compensations.py)."""
        return f"{self.deltas(run_id)}/{seq:010d}.undo"

    def staged_delta(self, run_id: int, lease_id: int, sha256: str) -> str:
        """Where an upload writes its bytes, durably, before it takes a sequence number: named by its
        lease and content, so the serial part of an acknowledgement holds no file operation. The
        merger (or a restart's replay) renames it to its sequence number with `adopt_delta`."""
        return f"{self.deltas(run_id)}/lease-{lease_id:010d}-{sha256[:32]}.staged"

    def checkpoints(self, run_id: int) -> str:
        """The folder of a run's checkpoints, one per version: `<version>.ckpt`."""
        return f"{self.run_dir(run_id)}/checkpoints"

    def checkpoint(self, run_id: int, version: int) -> str:
        return f"{self.checkpoints(run_id)}/{version:010d}.ckpt"

    # -- listings ---------------------------------------------------------------------------------

    def staged_deltas(self, run_id: int) -> Iterator[tuple[str, int, str]]:
        """Every staged delta of the run: (name, lease id, the start of its content's sha256)."""
        for name in self.blobs.list(self.deltas(run_id)):
            base = _base(name)
            if not (base.startswith("lease-") and base.endswith(".staged")):
                continue
            _, lease_part, sha_part = (_stem(name).split("-") + ["", ""])[:3]
            if lease_part.isdigit() and sha_part:
                yield name, int(lease_part), sha_part

    def list_checkpoints(self, run_id: int) -> list[tuple[int, str]]:
        """(version, name), newest first."""
        found = [(int(_stem(name)), name) for name in self.blobs.list(self.checkpoints(run_id))
                 if name.endswith(".ckpt") and _stem(name).isdigit()]
        return sorted(found, reverse=True)

    def list_updates(self, run_id: int) -> list[tuple[int, str]]:
        """(the version it starts from, name) of every model update of the run."""
        found = []
        for name in self.blobs.list(self.updates(run_id)):
            start, _, _ = _stem(name).partition("-")
            if name.endswith(".delta") and start.isdigit():
                found.append((int(start), name))
        return found

    # -- uploads ----------------------------------------------------------------------------------

    def receiving(self, run_id: int, lease_id: int) -> Path:
        """The escape hatch: a fresh local file for an upload's bytes while they arrive
        (`.lease-<id>-<random>.part` in the deltas folder, so `stage_received` is a rename): never
        adopted or replayed, deleted when its upload is refused, and when a crash left it behind
        (`partial_uploads`)."""
        return self.blobs.local_path(f"{self.deltas(run_id)}/.lease-{lease_id:010d}-{secrets.token_hex(8)}.part")

    def partial_uploads(self, run_id: int) -> list[str]:
        return [name for name in self.blobs.list(self.deltas(run_id))
                if _base(name).startswith(".lease-") and name.endswith(".part")]

    def stage_received(self, received: ReceivedBody, staged: str) -> None:
        """Make a streamed upload durable under its staged name (what `write` does, without the body
        ever being in memory)."""
        self.blobs.adopt_file(received.path, staged)

    def adopt_delta(self, run_id: int, seq: int, lease_id: int, sha256: str) -> str:
        """The name of delta `seq`, renamed from its staged name if it is not there yet (atomic: a
        crash leaves one name or the other)."""
        name = self.delta(run_id, seq)
        if not self.blobs.exists(name):
            staged = self.staged_delta(run_id, lease_id, sha256)
            if self.blobs.exists(staged):
                self.blobs.move(staged, name)
        return name

    # -- retention --------------------------------------------------------------------------------

    def pruned_through(self, run_id: int) -> int:
        """The version up to which this run's received deltas (and exchange bodies) were deleted; 0: none."""
        try:
            return int(self.blobs.read(f"{self.deltas(run_id)}/{PRUNED_MARK}").decode())
        except FileNotFoundError:
            return 0

    def prune_deltas(self, run_id: int, through: int) -> int:
        """Delete the deltas of sequence numbers up to `through`; returns how many went. The mark is
        written first, so a crash in between leaves blobs behind, never a gap nobody knows about."""
        self.blobs.write(f"{self.deltas(run_id)}/{PRUNED_MARK}", str(int(through)).encode())
        gone = 0
        for name in self.blobs.list(self.deltas(run_id)):
            if name.endswith(".delta") and _stem(name).isdigit() and int(_stem(name)) <= through:
                self.blobs.delete(name)
                gone += 1
        return gone
