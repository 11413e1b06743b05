"""shared/dataset.py + shared/sources.py: `prepare` on text, folder, jsonl and parquet sources, checked
against the texts themselves; the held-out split; bounded memory; bad inputs named with what to do."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from shared import dataset, sources
from shared.dataset import EVAL_BLOCK, open_tokens, prepare, read_manifest, verify
from shared.sources import Options, SourceError
from shared.tokenizer import EOT, Tokenizer, token_byte_lengths
from tests.conftest import peak_bytes

WORDS = "the model learns from bytes while idle machines train one shared network über café 日本".split()


def _text(n_lines: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))) + "\n" for _ in range(n_lines))


def _ids(folder: Path, m: dataset.Manifest) -> tuple[np.ndarray, np.ndarray]:
    train = np.concatenate([open_tokens(folder, s, m.dtype) for s in m.shards])
    return train, np.asarray(open_tokens(folder, m.eval, m.dtype))


def _interleave(train: np.ndarray, held: np.ndarray, period: int) -> np.ndarray:
    """The token stream back from its split: every period-th block of EVAL_BLOCK, from the first, went to eval."""
    out, t, e, j = [], 0, 0, 0
    while t < train.size or e < held.size:
        if j % period == 0:
            out.append(held[e:e + EVAL_BLOCK])
            e += EVAL_BLOCK
        else:
            out.append(train[t:t + EVAL_BLOCK])
            t += EVAL_BLOCK
        j += 1
    return np.concatenate(out)


def test_bytes_text_file_split_by_blocks(tmp_path):
    text = _text(8000)
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    m = prepare(tmp_path / "c.txt", tmp_path / "out", tokenizer="bytes", shard_tokens=50_000, eval_fraction=0.1)
    raw = np.frombuffer(text.encode(), dtype=np.uint8)
    assert (m.dtype, m.tokenizer.kind, m.tokenizer.vocab_size) == ("uint8", "bytes", 256)
    train, held = _ids(tmp_path / "out", m)
    assert np.array_equal(_interleave(train, held, 10), raw)
    # every 10th block of 4096 tokens is held out: 10% up to the ragged end
    assert held.size == EVAL_BLOCK * (raw.size // (10 * EVAL_BLOCK)) + min(EVAL_BLOCK, raw.size % (10 * EVAL_BLOCK))
    assert [s.n_tokens for s in m.shards[:-1]] == [50_000] * (len(m.shards) - 1)
    assert m.train_bytes + m.eval.n_bytes == len(text.encode())
    for entry in m.files():  # each hash is of the file's bytes
        assert hashlib.sha256((tmp_path / "out" / entry.file).read_bytes()).hexdigest() == entry.sha256
    assert read_manifest(tmp_path / "out") == m
    assert verify(tmp_path / "out", m).kind == "bytes"


def test_bpe_text_file_decodes_back_to_the_text(tmp_path):
    text = _text(3000)
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    m = prepare(tmp_path / "c.txt", tmp_path / "out", tokenizer="bpe", vocab_size=300, shard_tokens=4096,
                eval_tokens=2000)
    tok = Tokenizer.from_file(tmp_path / "out" / "tokenizer.json")
    assert (tok.sha256, tok.vocab_size, m.dtype) == (m.tokenizer.sha256, m.tokenizer.vocab_size, "uint16")
    train, held = _ids(tmp_path / "out", m)
    assert held.size == 2000
    stream = np.concatenate([held, train])  # --eval-tokens: the first N tokens are held out
    assert tok.decode(stream.tolist()) == text + EOT  # a text file is one document, then the separator
    assert stream.size < 0.7 * len(text.encode())  # BPE compresses
    lengths = token_byte_lengths(tok)
    assert lengths[held].sum() == m.eval.n_bytes and m.train_bytes + m.eval.n_bytes == len(text.encode())


def _hash_order(root: Path, files: list[Path]) -> list[Path]:
    return sorted(files, key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).digest())


def test_folder_recursive_with_jsonl_inside(tmp_path):
    root = tmp_path / "src"
    (root / "sub" / "deeper").mkdir(parents=True)
    docs = {root / "a.txt": _text(30, 1), root / "sub" / "b.md": _text(20, 2),
            root / "sub" / "deeper" / "c.py": "def f():\n    return 1\n"}
    for path, text in docs.items():
        path.write_text(text, encoding="utf-8")
    (root / "image.png").write_bytes(b"\x89PNG\x00\xff")  # not a text suffix: skipped
    records = [_text(2, 10 + i) for i in range(3)]
    (root / "sub" / "r.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    m = prepare(root, tmp_path / "out", tokenizer="bpe", vocab_size=320, shard_tokens=1024, eval_tokens=100)
    expected = ""
    for path in _hash_order(root, [*docs, root / "sub" / "r.jsonl"]):
        expected += "".join(r + EOT for r in records) if path.suffix == ".jsonl" else docs[path] + EOT
    tok = Tokenizer.from_file(tmp_path / "out" / "tokenizer.json")
    train, held = _ids(tmp_path / "out", m)
    assert tok.decode(np.concatenate([held, train]).tolist()) == expected
    assert (m.source["kind"], m.source["files"], m.source["documents"]) == ("folder", 4, 6)


def test_jsonl_named_field(tmp_path):
    records = [_text(3, i) for i in range(50)]
    lines = [json.dumps({"id": i, "content": r}) for i, r in enumerate(records)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n\n")  # a blank line is skipped
    m = prepare(tmp_path / "d.jsonl", tmp_path / "out", tokenizer="bpe", vocab_size=300, shard_tokens=1024,
                eval_tokens=64, opts=Options(text_field="content"))
    tok = Tokenizer.from_file(tmp_path / "out" / "tokenizer.json")
    train, held = _ids(tmp_path / "out", m)
    assert tok.decode(np.concatenate([held, train]).tolist()) == "".join(r + EOT for r in records)
    assert m.source["documents"] == 50


def test_parquet_column(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: pip install 'idletrain[test]'")
    import pyarrow.parquet as pq

    records = [_text(3, i) for i in range(3000)]  # several batches of 1024 rows
    pq.write_table(pa.table({"n": list(range(3000)), "body": records}), tmp_path / "d.parquet")
    m = prepare(tmp_path / "d.parquet", tmp_path / "out", tokenizer="bytes", shard_tokens=10_000, eval_tokens=5000,
                opts=Options(text_field="body"))
    train, held = _ids(tmp_path / "out", m)
    assert bytes(np.concatenate([held, train])) == "".join(records).encode()  # bytes: no separator
    assert m.source["documents"] == 3000


def test_a_tokenizer_file_above_65536_writes_uint32(tmp_path):
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    inner = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.save(str(tmp_path / "tok.json"))
    rng = random.Random(0)
    words = [rng.randrange(70_000) for _ in range(20_000)]
    (tmp_path / "c.txt").write_text(" ".join(f"w{w}" for w in words))
    m = prepare(tmp_path / "c.txt", tmp_path / "out", tokenizer=str(tmp_path / "tok.json"), shard_tokens=4096,
                eval_tokens=1000)
    assert (m.dtype, m.tokenizer.vocab_size, m.itemsize) == ("uint32", 70_000, 4)
    train, held = _ids(tmp_path / "out", m)
    assert np.concatenate([held, train]).tolist() == words
    assert (tmp_path / "out" / m.shards[0].file).stat().st_size == 4 * m.shards[0].n_tokens


def test_a_corpus_larger_than_the_memory_cap(tmp_path):
    """40 MB of text prepared with at most a quarter of it allocated at once (tracemalloc counts
    Python's and numpy's allocations: reading the file, or its tokens, whole would exceed it)."""
    line = _text(2000).encode()
    with open(tmp_path / "big.txt", "wb") as f:
        for _ in range((40 << 20) // len(line) + 1):
            f.write(line)
    size = (tmp_path / "big.txt").stat().st_size
    peak = peak_bytes(lambda: prepare(tmp_path / "big.txt", tmp_path / "out", tokenizer="bytes", shard_tokens=1 << 22))
    m = read_manifest(tmp_path / "out")
    assert m.train_tokens + m.eval.n_tokens == size
    assert peak < size / 4, f"peak {peak / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB corpus"


def test_bpe_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    """Both passes (training, tokenizing) stream: smaller pieces and batches bound the peak below a
    quarter of an 8 MB corpus."""
    monkeypatch.setattr(sources, "PIECE_BYTES", 1 << 15)
    monkeypatch.setattr(dataset, "BATCH_BYTES", 1 << 17)
    monkeypatch.setattr(dataset, "ENCODE_CHUNK", 1 << 13)
    line = _text(500).encode()
    with open(tmp_path / "big.txt", "wb") as f:
        for _ in range((8 << 20) // len(line) + 1):
            f.write(line)
    size = (tmp_path / "big.txt").stat().st_size
    peak = peak_bytes(lambda: prepare(tmp_path / "big.txt", tmp_path / "out", tokenizer="bpe", vocab_size=300,
                                 shard_tokens=1 << 20))
    assert read_manifest(tmp_path / "out").train_bytes > 0
    assert peak < size / 4, f"peak {peak / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB corpus"


# -- bad input ------------------------------------------------------------------------------------

def _fails(tmp_path, source, match, **kw):
    with pytest.raises(ValueError, match=match):
        prepare(source, tmp_path / "out", tokenizer=kw.pop("tokenizer", "bytes"), **kw)


def test_bad_inputs_name_the_file_and_what_to_do(tmp_path):
    _fails(tmp_path, tmp_path / "nope.txt", r"does not exist: give a text file")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good text\n" * 10 + b"\xff\xfe broken")
    _fails(tmp_path, bad, r"bad.txt: invalid UTF-8 at byte offset 100 .*--errors replace")
    m = prepare(bad, tmp_path / "ok", tokenizer="bytes", opts=Options(errors="replace"), eval_tokens=10)
    assert m.train_tokens + m.eval.n_tokens == 100 + 2 * 3 + 7  # each bad byte read as U+FFFD (3 bytes)
    js = tmp_path / "d.jsonl"
    js.write_text('{"text": "a"}\n{"text": "b"}\nnot json\n')
    _fails(tmp_path, js, r"d.jsonl, line 3: not JSON")
    js.write_text('{"text": "a"}\n{"text": "b", "id": 1\n')  # cut short: its fault, on the file's line 2
    _fails(tmp_path, js, r"d.jsonl, line 2: not JSON \(Expecting ',' delimiter at character 23 of the line; a record "
                         r"cut short")
    js.write_text('{"text": "a"}\n{"body": "b", "id": 2}\n')
    _fails(tmp_path, js, r"d.jsonl, line 2: no field 'text' \(its fields: 'body', 'id'\): name the text field with "
                         r"--text-field")
    js.write_text('{"text": "a"}\n{"text": null}\n')
    _fails(tmp_path, js, r"d.jsonl, line 2: the field 'text' is null, not a string")
    js.write_text("")  # as an empty .txt says it
    _fails(tmp_path, js, r"d.jsonl is empty \(no JSON record in it\): remove it from the corpus, or pass --skip-empty")
    js.write_text('{"text": "a"}\n{"text": ""}\n')
    _fails(tmp_path, js, r"d.jsonl, line 2: the field 'text' is empty: .*--skip-empty")
    js.write_text('["text"]\n')
    _fails(tmp_path, js, r"line 1: a JSON list, not an object")
    js.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    _fails(tmp_path, js, r"d.jsonl: invalid UTF-8 at byte offset 24")
    (tmp_path / "empty.txt").write_text("")
    _fails(tmp_path, tmp_path / "empty.txt", r"empty.txt is empty")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "x.bin").write_bytes(b"\x00")
    _fails(tmp_path, tmp_path / "nothing", r"holds no text, .jsonl or .parquet files")
    _fails(tmp_path, bad, r"between 257", tokenizer="bpe", vocab_size=10)
    _fails(tmp_path, bad, r"--eval-fraction must be in", eval_fraction=0.9)
    _fails(tmp_path, bad, r"gave 113 tokens, all held out", opts=Options(errors="replace"))
    assert not (tmp_path / "out").exists()  # nothing half-made is left behind


def test_parquet_without_the_column(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: pip install 'idletrain[test]'")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "d.parquet")
    _fails(tmp_path, tmp_path / "d.parquet", r"d.parquet has no column 'text' \(it has body\): .*--text-field")
    (tmp_path / "fake.parquet").write_text("not parquet")
    _fails(tmp_path, tmp_path / "fake.parquet", r"fake.parquet is not a parquet file")


def test_unreadable_file(tmp_path, monkeypatch):
    (tmp_path / "c.txt").write_text("x")

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("builtins.open", refuse)
    with pytest.raises(SourceError, match=r"c.txt cannot be read \(Permission denied\): check that"):
        list(sources.pieces(tmp_path / "c.txt"))


def test_out_must_be_new_or_empty(tmp_path):
    (tmp_path / "c.txt").write_text(_text(10))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep me")
    _fails(tmp_path, tmp_path / "c.txt", r"exists and is not an empty folder")


def test_a_damaged_folder_is_refused(tmp_path):
    (tmp_path / "c.txt").write_text(_text(3000))
    m = prepare(tmp_path / "c.txt", tmp_path / "out", tokenizer="bytes", shard_tokens=8192)
    shard = tmp_path / "out" / m.shards[1].file
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"000001.bin does not match the manifest's SHA-256"):
        verify(tmp_path / "out", m)
    shard.write_bytes(bytes(data[:-1]))
    with pytest.raises(ValueError, match=r"holds 8191 bytes, the manifest says 8192"):
        verify(tmp_path / "out", m)
    raw = json.loads((tmp_path / "out" / "manifest.json").read_text())
    raw["shards"][0]["file"] = "../../etc/passwd"
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"not a valid manifest .*shards/000000.bin"):
        read_manifest(tmp_path / "out")
    with pytest.raises(ValueError, match=r"cannot be read .*idletrain data prepare"):
        read_manifest(tmp_path)


def test_the_cli(tmp_path, capsys):
    from idletrain.cli import main

    (tmp_path / "c.txt").write_text(_text(2000))
    assert main(["data", "prepare", str(tmp_path / "c.txt"), "--out", str(tmp_path / "out"), "--tokenizer", "bpe",
                 "--vocab-size", "300", "--eval-tokens", "1000", "--shard-tokens", "4096", "--json", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["vocab_size"], summary["eval_tokens"], summary["dtype"]) == (300, 1000, "uint16")
    assert main(["data", "prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("idletrain: ") and "does not exist" in err and "Traceback" not in err


def test_every_file_of_a_prepared_folder_has_the_same_mode(tmp_path):
    """manifest.json was written 0600 (a temp file renamed) beside 0644 shards and tokenizer: another
    user of a shared folder (the coordinator's service account) could not read it."""
    import os
    import stat

    from shared.files import umask

    (tmp_path / "c.txt").write_text(_text(800), encoding="utf-8")
    prepare(tmp_path / "c.txt", tmp_path / "out", tokenizer="bytes", shard_tokens=10_000, eval_fraction=0.1)
    modes = {p.name: stat.S_IMODE(os.stat(p).st_mode) for p in (tmp_path / "out").iterdir() if p.is_file()}
    assert "manifest.json" in modes and set(modes.values()) == {0o666 & ~umask()}, modes
