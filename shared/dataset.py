"""Prepared datasets: a corpus tokenized once into shard files on disk, with a manifest.

    DIR/tokenizer.json        the tokenizer (shared/tokenizer.py)
    DIR/shards/000000.bin …   raw little-endian token ids (uint8 for the bytes tokenizer, uint16,
                              uint32 above 65,536 tokens), `shard_tokens` each (the last one fewer)
    DIR/eval.bin              the held-out split, the same dtype
    DIR/manifest.json         `Manifest`: the tokenizer's kind, hash and vocab, the dtype, each
                              file's tokens, UTF-8 bytes and SHA-256, the source; written last

`prepare` streams (shared/sources.py): a BPE is trained from an iterator of the texts, then a second
pass tokenizes them into the files; neither pass holds more than a batch of text. The held-out
split is every `period`-th block of EVAL_BLOCK tokens of the stream, the first block included (period
= 1 / eval_fraction), or with `eval_tokens` the first that many tokens. Bytes are counted so that a loss can be given in bits
per byte, comparable across tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared import sources
from shared.files import atomic_write
from shared.tokenizer import Tokenizer, TokenDtype, bytes_tokenizer, token_byte_lengths, train_bpe

FORMAT = "idletrain-dataset"
VERSION = 1
EVAL_BLOCK = 4096  # tokens: the unit the held-out split is taken in
BATCH_BYTES = 1 << 20  # text tokenized at once
ENCODE_CHUNK = 1 << 15  # characters: a piece is encoded in parts of about this, in parallel
SHARD_FILE = r"^shards/[0-9]{6}\.bin$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TokenFile(_Strict):
    file: str
    n_tokens: int = Field(ge=0)
    n_bytes: int = Field(ge=0, description="UTF-8 bytes of the text these tokens stand for")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="of the file's bytes")


class TokenizerInfo(_Strict):
    file: Literal["tokenizer.json"] = "tokenizer.json"
    kind: Literal["bytes", "bpe"]
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    vocab_size: int = Field(ge=2)
    eot_id: int | None = None


class Manifest(_Strict):
    format: Literal["idletrain-dataset"] = FORMAT
    version: Literal[1] = VERSION
    tokenizer: TokenizerInfo
    dtype: Literal["uint8", "uint16", "uint32"]
    shard_tokens: int = Field(ge=1)
    shards: list[TokenFile]
    eval: TokenFile
    source: dict
    train_tokens: int = Field(ge=0)
    train_bytes: int = Field(ge=0)

    @model_validator(mode="after")
    def _names(self) -> Manifest:
        for i, s in enumerate(self.shards):  # the coordinator opens these inside the folder: nothing else
            if not re.fullmatch(SHARD_FILE, s.file) or s.file != f"shards/{i:06d}.bin":
                raise ValueError(f"shard {i} is named {s.file!r}, not 'shards/{i:06d}.bin'")
        if self.eval.file != "eval.bin":
            raise ValueError(f"the eval split is named {self.eval.file!r}, not 'eval.bin'")
        if sum(s.n_tokens for s in self.shards) != self.train_tokens:
            raise ValueError("train_tokens is not the sum of the shards' tokens")
        return self

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def files(self) -> list[TokenFile]:
        return [*self.shards, self.eval]


def read_manifest(folder: str | Path) -> Manifest:
    """DIR/manifest.json, checked; ValueError saying what is wrong and what to do."""
    path = Path(folder) / "manifest.json"
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} cannot be read ({exc}): give a folder made by `idletrain data prepare`") from None
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        raise ValueError(f"{path} is not a valid manifest ({where}: {first['msg']}): prepare the folder again "
                         "with `idletrain data prepare`") from None


def open_tokens(folder: str | Path, entry: TokenFile, dtype: str) -> np.ndarray:
    """A token file memory-mapped (read-only), its size checked against the manifest."""
    path = Path(folder) / entry.file
    want = entry.n_tokens * np.dtype(dtype).itemsize
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ValueError(f"{path} cannot be read ({exc}): prepare the folder again") from None
    if size != want:
        raise ValueError(f"{path} holds {size} bytes, the manifest says {want}: the folder is damaged or "
                         "half-copied; prepare it again")
    if entry.n_tokens == 0:
        return np.zeros(0, dtype=np.dtype(dtype).newbyteorder("<"))
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def file_sha256(path: Path, *, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify(folder: str | Path, manifest: Manifest) -> Tokenizer:
    """Every file's size and SHA-256 against the manifest (read in chunks, never whole); the tokenizer."""
    folder = Path(folder)
    try:
        tok = Tokenizer.from_file(folder / manifest.tokenizer.file)
    except ValueError as exc:
        raise ValueError(f"{folder}: {exc}") from None
    if tok.sha256 != manifest.tokenizer.sha256:
        raise ValueError(f"{folder / 'tokenizer.json'} does not match the manifest's SHA-256: prepare the folder again")
    if tok.vocab_size != manifest.tokenizer.vocab_size:
        raise ValueError(f"{folder}: the tokenizer has {tok.vocab_size} tokens, the manifest says "
                         f"{manifest.tokenizer.vocab_size}")
    for entry in manifest.files():
        open_tokens(folder, entry, manifest.dtype)  # the size
        if file_sha256(folder / entry.file) != entry.sha256:
            raise ValueError(f"{folder / entry.file} does not match the manifest's SHA-256 (damaged or changed "
                             "after prepare): prepare the folder again")
    return tok


class _TokenFile:
    """A file tokens are appended to, hashed and counted as they go."""

    def __init__(self, folder: Path, name: str) -> None:
        self.name, self.path = name, folder / name
        self.f = open(self.path, "wb")
        self.h, self.n_tokens, self.n_bytes = hashlib.sha256(), 0, 0

    def add(self, ids: np.ndarray, n_bytes: int) -> None:
        raw = ids.tobytes()
        self.f.write(raw)
        self.h.update(raw)
        self.n_tokens, self.n_bytes = self.n_tokens + ids.size, self.n_bytes + n_bytes

    def close(self) -> TokenFile:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return TokenFile(file=self.name, n_tokens=self.n_tokens, n_bytes=self.n_bytes, sha256=self.h.hexdigest())


class _Sink:
    """Token ids in stream order -> the eval file (every period-th block, or the first eval_tokens)
    and shard files of shard_tokens each."""

    def __init__(self, out: Path, dtype: TokenDtype, lengths: np.ndarray, *, shard_tokens: int,
                 period: int | None, eval_tokens: int | None) -> None:
        self.out, self.dtype, self.lengths = out, np.dtype(dtype).newbyteorder("<"), lengths
        self.shard_tokens, self.period, self.eval_tokens = shard_tokens, period, eval_tokens
        self.pos = 0  # tokens seen
        self.eval = _TokenFile(out, "eval.bin")
        self.shards: list[TokenFile] = []
        self.current: _TokenFile | None = None

    def _to_eval(self) -> tuple[bool, int]:
        """Whether the token at self.pos is held out, and how many tokens from it on share that."""
        if self.eval_tokens is not None:
            left = self.eval_tokens - self.pos
            return (True, left) if left > 0 else (False, 1 << 62)
        block, into = divmod(self.pos, EVAL_BLOCK)
        return block % self.period == 0, EVAL_BLOCK - into

    def add(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while ids.size:
            held_out, run = self._to_eval()
            part, ids = ids[:run], ids[run:]
            self.pos += part.size
            if held_out:
                self.eval.add(part, int(self.lengths[part].sum()))
            else:
                self._train(part)

    def _train(self, part: np.ndarray) -> None:
        while part.size:
            if self.current is None:
                self.current = _TokenFile(self.out, f"shards/{len(self.shards):06d}.bin")
            take = part[: self.shard_tokens - self.current.n_tokens]
            self.current.add(take, int(self.lengths[take].sum()))
            part = part[take.size:]
            if self.current.n_tokens == self.shard_tokens:
                self.shards.append(self.current.close())
                self.current = None

    def close(self) -> tuple[list[TokenFile], TokenFile]:
        if self.current is not None:
            self.shards.append(self.current.close())
            self.current = None
        return self.shards, self.eval.close()


def _batches(source: Path, opts: sources.Options) -> Iterator[list[sources.Piece]]:
    batch, size = [], 0
    for piece in sources.pieces(source, opts):
        batch.append(piece)
        size += piece.n_bytes
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _chunks(text: str) -> list[str]:
    """`text` cut after line ends into parts of about ENCODE_CHUNK characters (encoded in parallel)."""
    out, i = [], 0
    while i < len(text):
        j = text.find("\n", i + ENCODE_CHUNK)
        j = len(text) if j < 0 else j + 1
        out.append(text[i:j])
        i = j
    return out


def _encode(tok: Tokenizer, batch: list[sources.Piece]) -> list[np.ndarray]:
    """Each piece's ids, a document's last piece followed by the separator (EOT) where there is one."""
    if tok.kind == "bytes":  # id i == byte i: no tokenizer needed
        out = [np.frombuffer(p.text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8) for p in batch]
    else:
        parts = [_chunks(p.text) for p in batch]
        encoded = iter(tok.inner.encode_batch([c for cs in parts for c in cs], add_special_tokens=False))
        out = [np.concatenate([np.asarray(next(encoded).ids, dtype=np.int32) for _ in cs] or
                              [np.zeros(0, np.int32)]) for cs in parts]  # ids < MAX_VOCAB = 2**24
    if tok.eot_id is not None:
        out = [np.append(ids, tok.eot_id) if p.last else ids for ids, p in zip(out, batch, strict=True)]
    return out


def make_tokenizer(spec: str, source: Path, opts: sources.Options, vocab_size: int) -> Tokenizer:
    """`bytes`, `bpe` (trained on `source`, streamed) or the path of a tokenizer.json."""
    if spec == "bytes":
        return bytes_tokenizer()
    if spec == "bpe":
        return train_bpe((p.text for p in sources.pieces(source, opts)), vocab_size)
    return Tokenizer.from_file(spec)


def prepare(source: str | Path, out: str | Path, *, tokenizer: str = "bpe", vocab_size: int = 8192,
            shard_tokens: int = 1 << 24, eval_fraction: float = 0.01, eval_tokens: int | None = None,
            opts: sources.Options = sources.Options(), log: Callable[[str], None] = lambda _: None) -> Manifest:
    """Tokenize `source` into `out` (a new or empty folder); the manifest, written last."""
    source, out = Path(source).expanduser(), Path(out).expanduser()
    if shard_tokens < 1024:
        raise ValueError(f"--shard-tokens must be at least 1024, got {shard_tokens}")
    if eval_tokens is None and not 0 < eval_fraction <= 0.5:
        raise ValueError(f"--eval-fraction must be in (0, 0.5], got {eval_fraction}")
    if eval_tokens is not None and eval_tokens < 1:
        raise ValueError(f"--eval-tokens must be positive, got {eval_tokens}")
    kind = sources.kind_of(source)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder: give another --out, or delete it first")
    made = not out.exists()
    (out / "shards").mkdir(parents=True, exist_ok=True)
    try:
        return _prepare(source, kind, out, tokenizer=tokenizer, vocab_size=vocab_size, shard_tokens=shard_tokens,
                        eval_fraction=eval_fraction, eval_tokens=eval_tokens, opts=opts, log=log)
    except BaseException:  # bad input, Ctrl-C: no half-made folder is left to look prepared
        if made:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for p in out.iterdir():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        raise


def _prepare(source: Path, kind: str, out: Path, *, tokenizer: str, vocab_size: int, shard_tokens: int,
             eval_fraction: float, eval_tokens: int | None, opts: sources.Options,
             log: Callable[[str], None]) -> Manifest:
    log(f"tokenizer: {tokenizer}" + (f" (training a BPE of {vocab_size} tokens on {source})" if tokenizer == "bpe"
                                     else ""))
    tok = make_tokenizer(tokenizer, source, opts, vocab_size)
    if tokenizer == "bpe" and tok.vocab_size < vocab_size:
        log(f"the corpus gave only {tok.vocab_size} tokens of the {vocab_size} asked for (no more merges to make)")
    tok.save(out / "tokenizer.json")
    sink = _Sink(out, tok.dtype, token_byte_lengths(tok), shard_tokens=shard_tokens,
                 period=None if eval_tokens is not None else max(2, round(1 / eval_fraction)),
                 eval_tokens=eval_tokens)
    n_docs = 0
    for batch in _batches(source, opts):
        for ids in _encode(tok, batch):
            if ids.size and int(ids.max()) >= tok.vocab_size:
                raise ValueError(f"the tokenizer produced id {int(ids.max())} outside its vocab of {tok.vocab_size}")
            sink.add(ids)
        n_docs += sum(p.last for p in batch)
        log(f"  {sink.pos:,} tokens, {len(sink.shards)} shards filled so far")
    shards, held_out = sink.close()
    if not shards:
        raise ValueError(f"{source} gave {sink.pos} tokens, all held out for evaluation: give a larger corpus, or "
                         "hold out fewer (--eval-tokens)")
    files = 1 if kind != "folder" else len(sources.folder_files(source))
    manifest = Manifest(
        tokenizer=TokenizerInfo(kind=tok.kind, sha256=tok.sha256, vocab_size=tok.vocab_size, eot_id=tok.eot_id),
        dtype=tok.dtype, shard_tokens=shard_tokens, shards=shards, eval=held_out,
        source={"path": str(source), "kind": kind, "files": files, "documents": n_docs,
                **({"text_field": opts.text_field} if kind != "text" else {}),
                "split": {"eval_tokens": eval_tokens} if eval_tokens is not None else
                {"eval_fraction": eval_fraction, "block_tokens": EVAL_BLOCK}},
        train_tokens=sum(s.n_tokens for s in shards), train_bytes=sum(s.n_bytes for s in shards))
    atomic_write(out / "manifest.json", (json.dumps(manifest.model_dump(), indent=1) + "\n").encode(), shared=True)
    return manifest
