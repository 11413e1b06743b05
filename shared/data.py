"""Corpus -> byte tokens -> fixed-size shards, plus a held-out eval split. Deterministic.

The built-in corpus is the running Python's own standard-library sources: present on every
machine with Python, so nothing is ever downloaded. Files are ordered by the SHA-256 of their
relative path (a fixed shuffle, so a size cap still samples the whole library) and every 20th
file is held out for evaluation, as in the published SPARTA measurements (docs/references.md).
A run may point at the operator's own text file or folder instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import torch

BUILTIN = "builtin:stdlib"
HELD_OUT_EVERY = 20  # every 20th file goes to the eval split
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # (N,) uint8 byte tokens
    eval: np.ndarray  # (M,) uint8 byte tokens, from files never seen in training
    n_files: int
    source: str


def _stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts]
    return root, files


def _folder_files(root: Path) -> list[Path]:
    # A symlink inside the folder that points out of it is skipped: a corpus folder is the whole of
    # what a run may read (coordinator/corpora.py checks the folder itself).
    real = root.resolve()
    return [p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
            and p.resolve().is_relative_to(real)]


def load_corpus(source: str = BUILTIN, *, max_bytes: int = 16 << 20) -> Corpus:
    """Read a corpus into train/eval byte arrays, at most about `max_bytes` in total."""
    if max_bytes < 4096:
        raise ValueError(f"max_bytes must be at least 4096, got {max_bytes}")
    if source == BUILTIN:
        root, files = _stdlib_files()
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise ValueError(f"corpus {source!r} does not exist: give a text file, a folder, or {BUILTIN!r}")
        if path.is_file():
            data = np.frombuffer(path.read_bytes()[:max_bytes], dtype=np.uint8)
            if data.size < 8192:
                raise ValueError(f"corpus file {source!r} is too small ({data.size} bytes; need 8 KiB)")
            cut = int(data.size * (1 - 1 / HELD_OUT_EVERY))  # the tail is held out
            return Corpus(train=data[:cut].copy(), eval=data[cut:].copy(), n_files=1, source=source)
        root, files = path, _folder_files(path)
    if not files:
        raise ValueError(f"corpus {source!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    keyed = sorted(files, key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).digest())
    train_parts: list[bytes] = []
    eval_parts: list[bytes] = []
    total = 0
    for i, path in enumerate(keyed):
        if total >= max_bytes and (eval_parts or i >= HELD_OUT_EVERY):
            break
        if total >= max_bytes and i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1:
            continue  # over the cap: skip ahead to the first held-out file so eval is never empty
        try:
            blob = path.read_bytes()
        except OSError:
            continue
        (eval_parts if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train_parts).append(blob)
        total += len(blob)
    train = np.frombuffer(b"".join(train_parts), dtype=np.uint8)
    evals = np.frombuffer(b"".join(eval_parts), dtype=np.uint8)
    if train.size < 8192 or evals.size < 1024:
        raise ValueError(f"corpus {source!r} is too small to train on ({train.size} + {evals.size} bytes)")
    return Corpus(train=train.copy(), eval=evals.copy(), n_files=len(keyed), source=source)


def cut_shards(tokens: np.ndarray, shard_tokens: int, *, shuffle_seed: int | None = None) -> list[np.ndarray]:
    """Non-overlapping shards of exactly `shard_tokens` (the ragged tail is dropped): consecutive
    pieces of the corpus, or with shuffle_seed those pieces in an order that seed shuffles (the same
    seed, the same order).

    The coordinator hands shards out by index, so in the corpus's own order the workers of one
    group would train neighbouring pieces together: one long file (a code-page table, a document
    of prose in a corpus of code) spans several shards, and a group of deltas all from it pulls the
    model one way, the next group back (which the direction screen can take for an attack)."""
    if shard_tokens < 2:
        raise ValueError("shard_tokens must be at least 2")
    n = tokens.size // shard_tokens
    if n == 0:
        raise ValueError(f"corpus of {tokens.size} tokens is smaller than one shard ({shard_tokens})")
    order = range(n) if shuffle_seed is None else np.random.default_rng(shuffle_seed).permutation(n)
    return [tokens[i * shard_tokens:(i + 1) * shard_tokens] for i in order]


def sha256_hex(data: bytes | np.ndarray) -> str:
    return hashlib.sha256(data.tobytes() if isinstance(data, np.ndarray) else data).hexdigest()


def tokens_from_bytes(raw: bytes | bytearray | memoryview, dtype: str = "uint8") -> torch.Tensor:
    """A 1-D token tensor from little-endian ids of `dtype` (a shard, the eval split): uint8 as it is,
    uint16 as int32 and uint32 as int64 (torch indexes neither unsigned type). ValueError when the
    bytes are not a whole number of ids."""
    width = np.dtype(dtype).itemsize
    if dtype not in ("uint8", "uint16", "uint32"):
        raise ValueError(f"token dtype {dtype!r} is not uint8, uint16 or uint32")
    if len(raw) % width:
        raise ValueError(f"{len(raw)} bytes are not a whole number of {dtype} tokens")
    ids = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    if dtype == "uint8":
        return torch.from_numpy(ids.copy())
    return torch.from_numpy(ids.astype(np.int32 if dtype == "uint16" else np.int64))


def sample_batch(tokens: torch.Tensor, *, batch_size: int, context: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of a 1-D token tensor: inputs (B, T) and next-token targets (B, T)."""
    if tokens.numel() < context + 1:
        raise ValueError(f"shard of {tokens.numel()} tokens is shorter than context+1 = {context + 1}")
    starts = torch.randint(0, tokens.numel() - context, (batch_size,), generator=generator)
    window = tokens[starts[:, None] + torch.arange(context + 1)].long()  # (B, T+1)
    return window[:, :-1], window[:, 1:]
