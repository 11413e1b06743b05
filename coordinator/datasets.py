"""A run's tokens, ready to store: from a raw corpus (read whole, bytes, as always) or from a prepared
folder (`idletrain data prepare`: streamed, one shard at a time, so a corpus of several GB fits).

`from_corpus` and `from_prepared` return a `RunTokens`: the counts the run's row needs, the eval
split, the tokenizer, the run's TokensConfig, and `store(storage, run_id)`, which writes the shards
as blobs (zstd of the raw little-endian ids, named by index in the run's shuffled order) and returns
their rows. Both cut the same way: consecutive pieces of `shard_tokens`, the ragged tail dropped, in
the order `shared.data.cut_shards` gives them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import zstandard

from coordinator.errors import Unprocessable
from coordinator.storage import Storage
from shared.config import RunConfig, TokensConfig
from shared.data import cut_shards, load_corpus
from shared.dataset import Manifest, open_tokens, read_manifest, verify
from shared.tokenizer import Tokenizer, bytes_tokenizer


@dataclasses.dataclass
class RunTokens:
    n_shards: int
    train_tokens: int
    eval: np.ndarray  # the held-out ids (a memory map for a prepared folder)
    tokenizer: Tokenizer
    tokens: TokensConfig
    store: Callable[[Storage, int], list[dict]]  # (storage, run_id) -> the shard rows
    unused_tokens: int = 0  # the ragged tail past the last whole shard: in no shard


def _write(storage: Storage, run_id: int, index: int, ids: np.ndarray, cctx: zstandard.ZstdCompressor) -> dict:
    raw = np.ascontiguousarray(ids).tobytes()
    storage.write(storage.shard(run_id, index), cctx.compress(raw))
    return {"run_id": run_id, "index": index, "n_tokens": int(ids.size), "sha256": hashlib.sha256(raw).hexdigest()}


def from_corpus(cfg: RunConfig, source: str) -> RunTokens:
    """A raw corpus (a text file, a folder, builtin:stdlib): byte tokens, the bytes tokenizer."""
    try:
        corpus = load_corpus(source, max_bytes=cfg.corpus_max_bytes)
        shards = cut_shards(corpus.train, cfg.shard_tokens, shuffle_seed=cfg.seed if cfg.shuffle_shards else None)
    except ValueError as exc:
        raise Unprocessable(str(exc)) from None
    tok = bytes_tokenizer()

    def store(storage: Storage, run_id: int) -> list[dict]:
        cctx = zstandard.ZstdCompressor(level=3)
        return [_write(storage, run_id, i, ids, cctx) for i, ids in enumerate(shards)]

    train_tokens = int(sum(x.size for x in shards))
    return RunTokens(n_shards=len(shards), train_tokens=train_tokens, eval=corpus.eval,
                     tokenizer=tok, tokens=TokensConfig(tokenizer="bytes", tokenizer_sha256=tok.sha256, dtype="uint8"),
                     store=store, unused_tokens=int(corpus.train.size) - train_tokens)


def pieces(folder: Path, manifest: Manifest, size: int) -> Iterator[np.ndarray]:
    """The training tokens of a prepared folder in consecutive pieces of `size` (the tail dropped),
    read from the memory-mapped shard files: at most one piece is ever copied into memory."""
    held: list[np.ndarray] = []
    n_held = 0
    for entry in manifest.shards:
        ids = open_tokens(folder, entry, manifest.dtype)
        at = 0
        while at < ids.size:
            take = ids[at:at + size - n_held]
            held.append(take)
            n_held, at = n_held + take.size, at + take.size
            if n_held == size:
                yield np.concatenate(held)
                held, n_held = [], 0


def from_prepared(cfg: RunConfig, folder: str) -> RunTokens:
    """A folder made by `idletrain data prepare`: its manifest checked against the run (the model's
    vocab is the tokenizer's), every file's size and SHA-256 verified (streamed), then the shards
    cut from the memory-mapped files as they are stored."""
    path = Path(folder)
    try:
        manifest = read_manifest(path)
    except ValueError as exc:
        raise Unprocessable(f"data {folder!r}: {exc}") from None
    vocab = manifest.tokenizer.vocab_size
    if cfg.model.vocab_size != vocab:
        raise Unprocessable(f"the model's vocab_size is {cfg.model.vocab_size} but the data's tokenizer has {vocab} "
                            f"tokens: set model.vocab_size (run create --vocab-size) to {vocab}")
    try:
        tok = verify(path, manifest)
        held_out = open_tokens(path, manifest.eval, manifest.dtype)
    except ValueError as exc:
        raise Unprocessable(str(exc)) from None
    n = manifest.train_tokens // cfg.shard_tokens
    if n == 0:
        raise Unprocessable(f"data {folder!r} holds {manifest.train_tokens} training tokens, fewer than one shard "
                            f"({cfg.shard_tokens}): lower shard_tokens")
    order = np.arange(n) if not cfg.shuffle_shards else np.random.default_rng(cfg.seed).permutation(n)
    index_of = np.empty(n, dtype=np.int64)
    index_of[order] = np.arange(n)  # piece i of the corpus is stored as shard index_of[i], as cut_shards orders them

    def store(storage: Storage, run_id: int) -> list[dict]:
        cctx = zstandard.ZstdCompressor(level=3)
        return [_write(storage, run_id, int(index_of[i]), ids, cctx)
                for i, ids in enumerate(pieces(path, manifest, cfg.shard_tokens))]

    tokens = TokensConfig(tokenizer=manifest.tokenizer.kind, tokenizer_sha256=tok.sha256, dtype=manifest.dtype)
    return RunTokens(n_shards=n, train_tokens=n * cfg.shard_tokens, eval=held_out, tokenizer=tok, tokens=tokens,
                     store=store, unused_tokens=manifest.train_tokens - n * cfg.shard_tokens)
