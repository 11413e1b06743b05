"""What a round starts from, fetched and checked: the lease itself (the coordinator is untrusted
too), its base model, kept current at the least cost, and its shard.

The base model: the copy held when the lease's base version is that copy's; else the change since
it (an int8 or int4 model update, a fraction of a snapshot's bytes, GET /updates/{from}/{to});
else the full snapshot (the first time, after sync.MAX_HOPS updates in a row, or when the
coordinator no longer keeps the version held). In a run with update_feedback the change is taken
from the copy itself (GET /updates/{from}/{to}/{copy_digest}), so its rounding does not add up and
no number of updates in a row calls for a snapshot; the coordinator says so on each such update.
Version 0, the first time, is built here from the run's seed, and only its hash is checked (a 304,
no body).

The shard: the cached copy (worker/caches.py, hashed again), else downloaded and checked; its ids
are the lease's token_dtype (uint8 bytes, uint16, uint32). The run's tokenizer.json is checked
(shared/tokenizer.py's from_served) and cached beside the shards, once per run.

Every download is capped at what the lease says it can weigh (worker/sizes.py). A snapshot or a
shard over its cap, failing its hash or its zstd is the coordinator's fault: fetched again with
backoff, TRIES times in all, then the lease is given up, and each lease given up so in a row waits
longer before the next is asked for (backoff_delay: 1 s doubling, 60 s at most).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import httpx
import torch

from shared import codec, protocol
from shared.algorithms import sync
from shared.data import tokens_from_bytes
from shared.errors import DeltaFormatError, SnapshotError
from shared.model import meta_schema
from shared.snapshot import decode_snapshot, version_zero
from shared.tokenizer import from_served
from worker import memory, sizes
from worker.caches import ShardCache
from worker.client import (
    LEASE_LOST,
    CoordinatorClient,
    CoordinatorError,
    IntegrityError,
    InvalidAnswer,
    backoff_delay,
    invalid_answer,
    why,
)
from worker.control import StopFlag
from worker.trainer import LocalTrainer

log = logging.getLogger(__name__)


Inputs = tuple[dict[str, torch.Tensor] | None, torch.Tensor]  # a round's base model (None: not needed), shard
_T = TypeVar("_T")


class Downloads:
    """The lease check, the held base model (`held`: (version, params)) and the shard fetch of one
    worker. The prefetch thread uses it too, while the round before trains: only it then changes
    `held`."""

    TRIES = 3  # downloads of a snapshot or a shard not as announced before the lease is given up

    def __init__(self, client: CoordinatorClient, shards: ShardCache, stop: StopFlag, trainer: LocalTrainer, *,
                 max_params: int) -> None:
        self.client, self.shards, self.stop, self.trainer = client, shards, stop, trainer
        self.max_params = max_params
        self.held: tuple[int, dict[str, torch.Tensor]] | None = None  # (version, params)
        self.hops = 0  # incremental updates applied since the last full snapshot (update_feedback's: not counted)
        self.feedback_runs: set[str] = set()  # runs whose updates came from this worker's copy (update_feedback)
        self.join_bytes: int | None = None  # what the first base cost to download (0: version 0 built here)
        self.tokenizers = ShardCache.tokenizers(shards.root.parent)  # beside the shards
        self.tokenizers_seen: set[str] = set()  # fetched (or tried) by this process
        self.given_up = 0  # leases given up in a row over bytes not as announced: the next waits longer

    def check(self, lease: protocol.Lease) -> None:
        """A lease not in the protocol's exact form (ids, hashes, names, model config) raises
        InvalidAnswer: the loop backs off and asks again. A model this machine was not set up to
        hold, sized on the meta device before anything of it exists, raises RuntimeError: every
        lease of the run is the same model, so the worker stops, saying which flag raises the limit."""
        try:  # again: a lease may come from disk or a test, not only through the client's parsing
            checked = protocol.Lease.model_validate(lease.model_dump())
        except ValueError as exc:
            raise invalid_answer(f"lease {lease.lease_id!r}", exc) from None
        # sized at the rows per pass the trainer will use (a batch too big at once goes in micro-batches)
        too_big = memory.lease_too_big(checked.model, max_params=self.max_params,
                                       batch_size=self.trainer.micro_batch(checked) or checked.inner.batch_size,
                                       group_adamw=checked.inner.second_moment_workers > 1)
        if too_big is not None:
            raise RuntimeError(f"run {lease.run!r}: {too_big}; not training it")

    def prepare(self, lease: protocol.Lease) -> Inputs:
        """(the prefetch thread) A lease just taken: checked, its base model when the trainer needs
        one, and its shard."""
        self.check(lease)
        base = self.base(lease) if self.trainer.needs_snapshot(lease) else None
        inputs = base, self.tokens(lease)
        self.given_up = 0
        return inputs

    def inputs(self, lease: protocol.Lease, *, resume: bool) -> Inputs | None:
        """The round's base model (None: a resumed round, or one the trainer needs none for) and its
        shard; None when the lease was lost meanwhile, or its bytes did not arrive intact (then it
        is given up)."""
        try:
            base = self.base(lease) if not resume and self.trainer.needs_snapshot(lease) else None
            inputs = base, self.tokens(lease)
            self.given_up = 0
            return inputs
        except CoordinatorError as exc:
            if exc.status not in LEASE_LOST:
                raise
            log.warning("lease %d: %s", lease.lease_id, why(exc))
        except (IntegrityError, SnapshotError) as exc:  # bytes that are not what the lease announced
            self.give_up(lease, exc)
        return None

    def give_up(self, lease: protocol.Lease, exc: BaseException) -> None:
        """A lease whose shard or base model does not arrive intact: hand it back (best effort: it
        expires anyway) so its shard goes to another worker, and ask for another after a wait that
        grows with each lease given up so in a row (a coordinator serving bad bytes is asked slower)."""
        self.given_up += 1
        delay = backoff_delay(self.given_up)
        log.warning("lease %d: %s; giving the lease up (%d in a row whose bytes were not as announced) and asking "
                    "for another in %.1f s", lease.lease_id, exc, self.given_up, delay)
        try:
            self.client.release(lease.lease_id)
        except (httpx.TransportError, CoordinatorError) as err:
            log.info("lease %d not given back (%s); it expires at its deadline", lease.lease_id, why(err))
        self.stop.event.wait(delay)

    def fetch(self, lease: protocol.Lease, what: str, get: Callable[[], _T]) -> _T:
        """get() until what it downloads arrives as announced: over its cap, failing its hash or its
        zstd, it is fetched again with backoff, TRIES times in all; then IntegrityError (the round
        gives the lease up). The first Ctrl-C ends a wait."""
        attempt = 0
        while True:
            try:
                return get()
            except IntegrityError as exc:
                attempt += 1
                if attempt >= self.TRIES or self.stop.event.is_set():
                    raise IntegrityError(f"{what} failed {attempt} downloads ({exc})") from None
                delay = backoff_delay(attempt)
                log.warning("lease %d: %s; fetching it again in %.1f s (%d/%d)", lease.lease_id, exc, delay,
                            attempt + 1, self.TRIES)
                self.stop.event.wait(delay)

    def base(self, lease: protocol.Lease) -> dict[str, torch.Tensor]:
        """The lease's base model: the copy held, the change since it, or the full snapshot."""
        held = self.held
        if held is not None and held[0] == lease.base_version:
            return held[1]
        schema = meta_schema(lease.model)  # shapes only: nothing allocated
        if held is not None and held[0] < lease.base_version and self.hops < sync.MAX_HOPS:
            params = self._update(lease, held, schema)
            if params is not None:
                return params
        made = None  # version 0 made here from the run's seed: only its hash is checked, nothing downloaded
        if held is None and lease.base_version == 0 and lease.init_seed is not None:
            made = version_zero(lease.run, lease.model, lease.init_seed)
        blob, version = self.fetch(lease, f"snapshot {lease.base_version}", lambda: self.client.snapshot(
            lease.run, lease.base_version, if_sha256=made[1] if made else None,
            max_bytes=sizes.snapshot_cap_bytes(schema)))
        if blob is None:
            params = made[0]
        else:
            if made is not None:
                log.info("version 0 built from the run's seed differs from the coordinator's; downloaded it")
            params, _ = decode_snapshot(blob, schema=schema)
        self.held, self.hops = (version, params), 0
        if self.join_bytes is None:
            self.join_bytes = 0 if blob is None else len(blob)
        return params

    def _update(self, lease: protocol.Lease, held: tuple[int, dict[str, torch.Tensor]],
                schema: dict) -> dict[str, torch.Tensor] | None:
        """The held copy moved to the lease's base version by the coordinator's model update; None
        when there is none to use (the snapshot is downloaded instead)."""
        try:
            copy = sync.copy_digest(held[1]) if lease.run in self.feedback_runs else None
            blob, feedback = self.client.model_update(lease.run, held[0], lease.base_version, copy=copy,
                                                      max_bytes=sizes.update_cap_bytes(schema))
            update = codec.decode(blob, schema=schema)
            if update.base_version != held[0]:
                raise DeltaFormatError(f"update starts at version {update.base_version}, not {held[0]}")
            params = {n: t.clone() for n, t in held[1].items()}
            sync.apply_update(params, update)
            if feedback:  # the coordinator now holds this very copy: its rounding is carried, not added up
                self.feedback_runs.add(lease.run)
            self.held, self.hops = (lease.base_version, params), 0 if feedback else self.hops + 1
            return params
        except CoordinatorError as exc:
            if exc.status not in (404, 410, 422):
                raise
            log.info("no update %d -> %d (%s); downloading the snapshot", held[0], lease.base_version, why(exc))
        except (DeltaFormatError, IntegrityError) as exc:
            log.warning("update %d -> %d unusable (%s); downloading the snapshot", held[0], lease.base_version, exc)
        return None

    def tokens(self, lease: protocol.Lease) -> torch.Tensor:
        """The lease's shard: the cached copy (hashed again), else downloaded and checked (fetch)."""
        try:
            raw = self.shards.get(lease.shard_sha256)
        except ValueError as exc:  # not a digest: never made into a path
            raise InvalidAnswer(f"lease {lease.lease_id}: {exc}") from None
        if raw is None:
            raw = self.fetch(lease, f"shard {lease.shard_id}", lambda: self.client.shard(
                lease.run, lease.shard_id, expected_sha256=lease.shard_sha256,
                max_bytes=sizes.shard_cap_bytes(lease.token_dtype),
                max_raw_bytes=sizes.shard_raw_cap_bytes(lease.token_dtype)))
            self.shards.put(lease.shard_sha256, raw)
        self.fetch_tokenizer(lease)
        try:
            return tokens_from_bytes(raw, lease.token_dtype)
        except ValueError as exc:  # its hash matched: the coordinator's shard and dtype disagree
            raise IntegrityError(f"shard {lease.shard_id}: {exc}") from None

    def fetch_tokenizer(self, lease: protocol.Lease) -> None:
        """The run's tokenizer.json into the cache (by hash), once per run, checked before it is kept:
        its size, its form and its vocab against the lease's model (from_served). Training does not
        need it, so a failure is logged, nothing is kept, and the round goes on."""
        sha = lease.tokenizer_sha256
        if sha is None or sha in self.tokenizers_seen:
            return
        self.tokenizers_seen.add(sha)
        vocab = lease.model.vocab_size
        try:
            if self.tokenizers.get(sha) is None:
                raw = self.client.tokenizer(lease.run, expected_sha256=sha, max_bytes=sizes.tokenizer_cap_bytes(vocab))
                from_served(raw, vocab_size=vocab, source=f"run {lease.run!r}'s tokenizer")
                self.tokenizers.put(sha, raw)
        except (ValueError, IntegrityError, CoordinatorError, httpx.TransportError, OSError) as exc:
            log.warning("run %s: its tokenizer was refused or not fetched (%s); nothing kept, training goes on "
                        "without it", lease.run, exc)
