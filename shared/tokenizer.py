"""A run's tokenizer: text <-> token ids, as a Hugging Face `tokenizers` JSON file.

Two kinds:

    bytes   today's byte-level tokenizer: token id i is byte value i, vocab 256, no special token.
            Expressed as a byte-level BPE with no merges (each byte's ByteLevel character maps to
            its byte value), so `transformers.AutoTokenizer` loads it like any other.
    bpe     a byte-level BPE: trained here from an iterator of texts (`train_bpe`, the corpus never
            whole in memory) with `<|endoftext|>` as the document separator, or any tokenizer.json
            the operator brings (`Tokenizer.from_file`).

The file travels to workers as a content-hashed blob (`sha256` of `to_json()`'s UTF-8), never from
a hub; a worker checks what it receives (`from_served`: size, form, vocab) before keeping it. Token
ids are stored in the narrowest dtype that holds the vocab (`token_dtype`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"  # the document separator of trained BPE tokenizers
MIN_BPE_VOCAB = 257  # the 256 byte-level characters and EOT
MAX_VOCAB = 1 << 24
# A tokenizer.json weighs a few dozen bytes a token (its vocab entry and its merge): BPEs trained here
# measured 17 (vocab 512) to 33 (65,536) bytes a token, Llama 2's file is 57, a unigram's (T5) 75.
JSON_BYTES_PER_TOKEN = 256
JSON_SLACK_BYTES = 1 << 20  # the normalizer, pre-tokenizer, post-processor and added tokens
MODEL_TYPES = frozenset(("BPE", "WordPiece", "WordLevel", "Unigram"))  # the `tokenizers` library's models
TokenDtype = Literal["uint8", "uint16", "uint32"]


def token_dtype(vocab_size: int, *, kind: str = "bpe") -> TokenDtype:
    """The dtype token ids are stored in: uint8 for the bytes tokenizer, else uint16, and uint32 for a
    vocab above 65,536."""
    if kind == "bytes":
        return "uint8"
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@functools.cache
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's bytes_to_unicode: the printable character ByteLevel writes for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


class Tokenizer:
    """A `tokenizers.Tokenizer` with what idletrain needs of it: ids in and out, its JSON and hash."""

    def __init__(self, inner: tokenizers.Tokenizer) -> None:
        self.inner = inner
        self._json = inner.to_str()
        self.sha256 = hashlib.sha256(self._json.encode()).hexdigest()
        self.vocab_size = inner.get_vocab_size(with_added_tokens=True)
        self.kind: Literal["bytes", "bpe"] = "bytes" if self.sha256 == _bytes_sha256() else "bpe"
        self.eot_id: int | None = inner.token_to_id(EOT)

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]}…)"

    @property
    def dtype(self) -> TokenDtype:
        return token_dtype(self.vocab_size, kind=self.kind)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Several texts at once (on the library's threads)."""
        return [e.ids for e in self.inner.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens included; bytes that are not UTF-8 become U+FFFD, never an error."""
        return self.inner.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        """The tokenizer.json content (what travels and what `sha256` is of)."""
        return self._json

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self._json, encoding="utf-8")

    @classmethod
    def from_json(cls, text: str, *, source: str = "tokenizer JSON") -> Tokenizer:
        try:
            inner = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # the library raises a bare Exception for a malformed file
            raise ValueError(f"{source} is not a tokenizers JSON file ({exc}); give a tokenizer.json "
                             "saved by the Hugging Face tokenizers library") from None
        tok = cls(inner)
        if tok.vocab_size < 2 or tok.vocab_size > MAX_VOCAB:
            raise ValueError(f"{source}: a vocab of {tok.vocab_size} tokens is outside 2..{MAX_VOCAB}")
        return tok

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"tokenizer file {str(path)!r} cannot be read ({exc}): give the path of a "
                             "tokenizer.json") from None
        return cls.from_json(text, source=f"tokenizer file {str(path)!r}")


def max_json_bytes(vocab_size: int) -> int:
    """The most a tokenizer.json of `vocab_size` tokens can weigh: what one from elsewhere is capped at."""
    return JSON_BYTES_PER_TOKEN * vocab_size + JSON_SLACK_BYTES


def from_served(raw: bytes, *, vocab_size: int, source: str) -> Tokenizer:
    """A tokenizer.json from elsewhere (a coordinator's), checked before the library parses it: at most
    max_json_bytes(vocab_size), UTF-8 JSON in the `tokenizers` form whose vocab, merges and added
    tokens are no longer than the vocab; then loaded by `tokenizers` alone (never pickle), its ids
    within the model's: `vocab_size` tokens, or the bytes tokenizer in a vocab of 256 or more (a
    raw corpus's run). ValueError saying what is wrong."""
    cap = max_json_bytes(vocab_size)
    if len(raw) > cap:
        raise ValueError(f"{source} is {len(raw):,} bytes, over the {cap:,} a tokenizer of {vocab_size:,} tokens "
                         "can weigh")
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{source} is not UTF-8 JSON ({str(exc)[:200]})") from None
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict) or model.get("type") not in MODEL_TYPES:
        raise ValueError(f"{source} is not a tokenizers file: its model is none of {', '.join(sorted(MODEL_TYPES))}")
    for name, value in (("vocab", model.get("vocab")), ("merges", model.get("merges")),
                        ("added tokens", doc.get("added_tokens"))):
        if isinstance(value, list | dict) and len(value) > vocab_size:
            raise ValueError(f"{source}: {len(value):,} entries in its {name}, more than the model's vocab of "
                             f"{vocab_size:,}")
    tok = Tokenizer.from_json(text, source=source)
    if tok.kind == "bytes" and vocab_size >= 256:
        return tok
    top = max(tok.inner.get_vocab(with_added_tokens=True).values(), default=-1)
    if tok.vocab_size != vocab_size or top >= vocab_size:
        raise ValueError(f"{source} has {tok.vocab_size:,} tokens (ids up to {top:,}), the run's model "
                         f"{vocab_size:,}")
    return tok


def _bytes_inner() -> tokenizers.Tokenizer:
    chars = _byte_chars()
    inner = tokenizers.Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    return inner


@functools.cache
def _bytes_json() -> str:
    return _bytes_inner().to_str()


@functools.cache
def _bytes_sha256() -> str:
    return hashlib.sha256(_bytes_json().encode()).hexdigest()


def bytes_tokenizer() -> Tokenizer:
    """Today's tokenizer: id i == byte value i (vocab 256), the demo's and every raw-corpus run's."""
    return Tokenizer(tokenizers.Tokenizer.from_str(_bytes_json()))


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens (EOT, the 256 byte characters, then merges) trained
    from an iterator: only the counts of distinct words are held, never the texts."""
    if not MIN_BPE_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"a BPE vocab size must be between {MIN_BPE_VOCAB} (the 256 bytes and {EOT}) and "
                         f"{MAX_VOCAB}, got {vocab_size}")
    inner = tokenizers.Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    inner.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(inner)


def load(spec: str) -> Tokenizer:
    """`bytes`, or the path of a tokenizer.json."""
    return bytes_tokenizer() if spec == "bytes" else Tokenizer.from_file(spec)


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """(vocab_size,) int64: the UTF-8 bytes each token stands for (0 for special tokens such as EOT),
    so that a count of tokens becomes a count of bytes (bits per byte). Exact for byte-level
    tokenizers; for others, the bytes of the token decoded alone."""
    if tok.kind == "bytes":
        return np.ones(256, dtype=np.int64)
    out = np.zeros(tok.vocab_size, dtype=np.int64)
    alphabet = frozenset(_byte_chars())
    special = {i for i, t in tok.inner.get_added_tokens_decoder().items() if t.special}
    for text, i in tok.inner.get_vocab(with_added_tokens=True).items():
        if i in special or not 0 <= i < tok.vocab_size:
            continue
        out[i] = len(text) if alphabet.issuperset(text) else len(tok.decode([i]).encode())
    return out


def describe(tok: Tokenizer) -> dict:
    """What a manifest records of a tokenizer."""
    return {"kind": tok.kind, "sha256": tok.sha256, "vocab_size": tok.vocab_size, "dtype": tok.dtype,
            "eot_id": tok.eot_id}


__all__ = ["EOT", "Tokenizer", "bytes_tokenizer", "describe", "from_served", "load", "max_json_bytes",
           "token_byte_lengths", "token_dtype", "train_bpe"]
