"""Downloads: model snapshots, model updates (the int8 change between two kept versions, or with the
run's update_feedback the change from the worker's own copy), shards and the run's tokenizer."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import torch

from coordinator.db import Database
from coordinator.errors import Forbidden, Gone, NotFound, Unprocessable
from coordinator.queries import runs as run_rows
from coordinator.queries import versions as version_rows
from coordinator.services.common import Caller, named_run
from coordinator.services.live import LiveRuns
from coordinator.storage import Storage
from coordinator.traffic import Traffic
from shared import codec
from shared.algorithms import sync
from shared.config import RunConfig
from shared.snapshot import decode_snapshot
from shared.tokenizer import bytes_tokenizer


class DownloadService:
    def __init__(self, db: Database, storage: Storage, *, traffic: Traffic, live: LiveRuns,
                 copies_keep: int = 64) -> None:
        self.db, self.storage, self.traffic, self.live = db, storage, traffic, live
        # the workers' copies a run with update_feedback keeps (the newest, each one fp32 model): a worker
        # whose copy is gone is answered 410 and takes the snapshot, so this bounds the disk, never correctness
        self.copies_keep = copies_keep
        # one model update built at a time in this process: a build holds two decoded snapshots and
        # seconds of CPU, and the workers that held the same version ask for the same update at once;
        # those waiting read the blob the first one built
        self._update_build_lock = threading.Lock()
        self.updates_built = 0  # builds in this process (tests and operators: misses, not requests)

    def snapshot(self, run_name: str, version: str | int, *,
                 if_none_match: str | None = None) -> tuple[bytes | None, int, str]:
        """(blob, version, sha256); blob is None when `if_none_match` is the current ETag (nothing sent or counted)."""
        with self.db.read() as c:
            row = named_run(version_rows.snapshot_of(c, run_name, None if version == "latest" else int(version)),
                            run_name)
        v = row.version
        if row.sha256 is None:
            if 0 <= v <= row.run_version:
                raise Gone(f"version {v} is no longer kept; fetch snapshots/latest")
            raise NotFound(f"run {run_name!r} has no version {v} (latest is {row.run_version})")
        if if_none_match == f'"{row.sha256}"':
            return None, v, row.sha256
        try:
            blob = self.storage.read(self.storage.snapshot(row.run_id, v))
        except FileNotFoundError:
            raise Gone(f"version {v} is no longer kept; fetch snapshots/latest") from None
        self.traffic.add(row.run_id, down_model=len(blob))
        return blob, v, row.sha256

    def model_update(self, run_name: str, from_version: int, to_version: int, *, copy: str | None = None,
                     worker: Caller | None = None) -> tuple[bytes, str, bool]:
        """(blob, sha256, from the worker's copy): the change from one kept version to a later one, int8
        or int4 by the run's update_values (shared/algorithms/sync.py).

        Built once per (from, to) and kept beside the snapshots, so the workers that hold the same
        version share it: one build at a time per process, and requests arriving during a build of
        their pair wait for its blob instead of building it again. A version that is no longer kept
        answers 410 (fetch the full snapshot).

        With the run's update_feedback, the change from the worker's copy `copy` (its copy_digest; asked
        by `worker`, one of the run's) instead: see feedback_update; without `copy`, from `from_version`
        itself, built once per (from, to) and kept as above."""
        if to_version <= from_version:
            raise Unprocessable(f"an update goes forward: {from_version} -> {to_version} does not")
        with self.db.read() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
            if worker is not None and worker.run_id != run.id:
                raise Forbidden(f"this worker is registered with another run, not {run_name!r}")
            if to_version > run.version:
                raise NotFound(f"run {run_name!r} has no version {to_version} (latest is {run.version})")
            kept = version_rows.kept(c, run.id, [from_version, to_version])
        if RunConfig.model_validate_json(run.config_json).update_feedback:
            if to_version not in kept:
                raise Gone(f"version {to_version} is no longer kept; fetch the latest snapshot instead")
            # the same for every worker that holds from_version itself, or the same copy: built once, kept
            name = (self.storage.update(run.id, from_version, to_version) if copy is None
                    else self.storage.copy_update(run.id, copy, to_version))
            try:
                blob = self.storage.read(name)
            except FileNotFoundError:
                blob = self.feedback_update(run.id, run.config_json, from_version, to_version, copy, keep_as=name)
            self.traffic.add(run.id, down_model=len(blob))
            return blob, hashlib.sha256(blob).hexdigest(), True
        if len(kept) < 2:
            missing = from_version if from_version not in kept else to_version
            raise Gone(f"version {missing} is no longer kept; fetch snapshots/{to_version} instead")
        name = self.storage.update(run.id, from_version, to_version)
        try:
            blob = self.storage.read(name)
        except FileNotFoundError:
            with self._update_build_lock:
                try:  # built by another request while this one waited
                    blob = self.storage.read(name)
                except FileNotFoundError:
                    blob = self.build_update(run.id, run.config_json, from_version, to_version)
                    self.storage.write(name, blob)
                    self.updates_built += 1
        self.traffic.add(run.id, down_model=len(blob))
        return blob, hashlib.sha256(blob).hexdigest(), False

    def feedback_update(self, run_id: int, config_json: str, from_version: int, to_version: int,
                        copy: str | None, *, keep_as: str | None = None) -> bytes:
        """The change from the worker's copy to `to_version` (sync.feedback_update), and the copy it
        makes kept under its digest for the worker's next update. The copy is one this run kept, or
        `from_version`'s snapshot when `copy` is its digest or not given; any other answers 410 (a copy
        pruned, or one the worker made some other way: it takes the snapshot). With `keep_as` the blob is
        kept under that name, and a request waiting on the build lock reads it there instead of building
        it again: a retry, and workers holding the same copy (same copy, same version: same bytes)."""
        schema = self.live.schema_of(run_id)
        values = RunConfig.model_validate_json(config_json).update_values
        with self._update_build_lock:
            if keep_as is not None:
                try:  # built by another request while this one waited
                    return self.storage.read(keep_as)
                except FileNotFoundError:
                    pass
            base = self._read_copy(run_id, copy, schema) if copy is not None else None
            if base is None:
                try:
                    base, _ = decode_snapshot(self.storage.read(self.storage.snapshot(run_id, from_version)),
                                              schema=schema)
                except FileNotFoundError:
                    raise Gone(f"version {from_version} is no longer kept; fetch snapshots/{to_version}") from None
                if copy is not None and sync.copy_digest(base) != copy:
                    raise Gone(f"the copy {copy[:12]}... is not kept here; fetch snapshots/{to_version}")
            try:
                new, _ = decode_snapshot(self.storage.read(self.storage.snapshot(run_id, to_version)), schema=schema)
            except FileNotFoundError:
                raise Gone(f"version {to_version} is no longer kept; fetch the latest snapshot") from None
            blob, moved = sync.feedback_update(base, new, from_version=from_version, values=values, schema=schema)
            name = self.storage.copy(run_id, sync.copy_digest(moved))
            if not self.storage.exists(name):
                self.storage.write(name, [moved[n].numpy().astype("<f4", copy=False).tobytes() for n in sorted(moved)])
            if keep_as is not None:
                self.storage.write(keep_as, blob)
            self._prune_copies(run_id)
            self.updates_built += 1
        return blob

    def _read_copy(self, run_id: int, digest: str, schema: dict) -> dict[str, torch.Tensor] | None:
        """A kept copy by its digest (None: not kept)."""
        try:
            raw = self.storage.read(self.storage.copy(run_id, digest))
        except FileNotFoundError:
            return None
        flat = np.frombuffer(raw, dtype="<f4")
        out, at = {}, 0
        for n in sorted(schema):
            numel = int(np.prod(schema[n]))
            out[n] = torch.from_numpy(flat[at:at + numel].astype(np.float32)).reshape(schema[n])
            at += numel
        if at != flat.size:  # not this model's: never used
            return None
        return out

    def _prune_copies(self, run_id: int) -> None:
        """The newest copies_keep copies stay, with the updates built from them; the rest go."""
        names = self.storage.list(self.storage.copies(run_id))
        copies = sorted((n for n in names if n.endswith(".f32")), key=self.storage.modified_at)
        kept = {_copy_of(n) for n in copies[-self.copies_keep:]}
        for name in names:
            if _copy_of(name) not in kept:
                self.storage.delete(name)

    def build_update(self, run_id: int, config_json: str, from_version: int, to_version: int) -> bytes:
        """The encoded change from one version's snapshot to another's."""
        schema = self.live.schema_of(run_id)
        try:
            old, _ = decode_snapshot(self.storage.read(self.storage.snapshot(run_id, from_version)), schema=schema)
            new, _ = decode_snapshot(self.storage.read(self.storage.snapshot(run_id, to_version)), schema=schema)
        except FileNotFoundError:
            raise Gone(f"a snapshot between {from_version} and {to_version} is no longer kept; "
                       f"fetch snapshots/{to_version} instead") from None
        values = RunConfig.model_validate_json(config_json).update_values  # parsed only on a miss
        return codec.encode(sync.model_update(old, new, from_version=from_version, values=values))

    def shard(self, run_name: str, shard_index: int, worker: Caller) -> tuple[bytes, str]:
        with self.db.read() as c:
            row = named_run(version_rows.shard_of(c, run_name, shard_index), run_name)
        if worker.run_id != row.run_id:
            raise Forbidden(f"this worker is registered with another run, not {run_name!r}")
        if row.sha256 is None:
            raise NotFound(f"run {run_name!r} has no shard {shard_index}")
        blob = self.storage.read(self.storage.shard(row.run_id, row.index))
        self.traffic.add(row.run_id, worker.id, down_data=len(blob))
        return blob, row.sha256

    def tokenizer(self, run_name: str, *, if_none_match: str | None = None) -> tuple[bytes | None, str]:
        """(the run's tokenizer.json, its sha256); None when `if_none_match` is its ETag. Runs from
        before tokenizers were stored are the bytes tokenizer's."""
        with self.db.read() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
        sha = RunConfig.model_validate_json(run.config_json).tokens.tokenizer_sha256
        if sha is None:
            legacy = bytes_tokenizer()
            sha, blob = legacy.sha256, legacy.to_json().encode()
        elif if_none_match == f'"{sha}"':
            return None, sha
        else:
            try:
                blob = self.storage.read(self.storage.tokenizer(run.id))
            except FileNotFoundError:
                raise NotFound(f"run {run_name!r} has lost its tokenizer file; the operator must restore "
                               f"{self.storage.tokenizer(run.id)} in the data dir") from None
        if if_none_match == f'"{sha}"':
            return None, sha
        self.traffic.add(run.id, down_data=len(blob))
        return blob, sha


def _copy_of(name: str) -> str:
    """The copy a file of the copies folder belongs to: `<digest>.f32` or `<digest>.<to>.delta`."""
    return name.rsplit("/", 1)[-1].split(".", 1)[0]
