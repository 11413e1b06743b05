"""Corpus loading, shards and batches (shared/data.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.data import BUILTIN, HELD_OUT_EVERY, cut_shards, load_corpus, sample_batch, sha256_hex


def write_files(root, n: int, size: int = 600, suffix: str = ".txt", first: int = 0):
    """n files whose every line names the file, so each byte can be traced to its file."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(first, first + n):
        line = f"<file {i:04d}> lorem ipsum dolor sit amet\n".encode()
        (root / f"f{i:04d}{suffix}").write_bytes((line * (size // len(line) + 1))[:size])
    return root


def file_ids(blob: np.ndarray) -> set[str]:
    text = blob.tobytes().decode()
    return {text[j + 6:j + 10] for j in range(len(text)) if text.startswith("<file ", j)}


def test_folder_corpus_split_is_by_file_and_disjoint(tmp_path):
    root = write_files(tmp_path / "c", 60)
    (root / "skip.bin").write_bytes(b"\x00" * 5000)  # not a text suffix
    (root / "sub").mkdir()
    write_files(root / "sub", 3, suffix=".md", first=100)
    c = load_corpus(str(root))
    assert c.n_files == 63 and c.source == str(root)
    assert c.train.dtype == np.uint8 and c.eval.dtype == np.uint8
    assert c.train.size + c.eval.size == 63 * 600
    train_ids, eval_ids = file_ids(c.train), file_ids(c.eval)
    assert len(eval_ids) == 63 // HELD_OUT_EVERY == 3
    assert not train_ids & eval_ids  # no file contributes to both splits
    assert len(train_ids | eval_ids) == 63
    assert b"\x00" not in c.train.tobytes()


def test_folder_corpus_is_deterministic(tmp_path):
    root = write_files(tmp_path / "c", 45)
    a, b = load_corpus(str(root)), load_corpus(str(root))
    assert np.array_equal(a.train, b.train) and np.array_equal(a.eval, b.eval)
    # the order depends on relative paths only, not on where the folder lives
    moved = write_files(tmp_path / "elsewhere" / "c", 45)
    m = load_corpus(str(moved))
    assert sha256_hex(m.train) == sha256_hex(a.train) and sha256_hex(m.eval) == sha256_hex(a.eval)


def test_folder_corpus_respects_max_bytes(tmp_path):
    root = write_files(tmp_path / "c", 200, size=1000)
    c = load_corpus(str(root), max_bytes=50_000)
    total = c.train.size + c.eval.size
    assert 50_000 <= total < 51_000  # stops at the first file past the cap


def test_single_file_corpus(tmp_path):
    data = bytes(range(256)) * 100  # 25,600 bytes
    path = tmp_path / "one.txt"
    path.write_bytes(data)
    c = load_corpus(str(path))
    assert c.n_files == 1
    cut = int(len(data) * (1 - 1 / HELD_OUT_EVERY))
    assert c.train.tobytes() == data[:cut] and c.eval.tobytes() == data[cut:]  # held-out tail
    capped = load_corpus(str(path), max_bytes=10_000)
    assert capped.train.size + capped.eval.size == 10_000
    c.train[0] = 99  # the arrays are the corpus's own: writable, not views of a bytes object
    assert load_corpus(str(path)).train[0] == 0


def test_builtin_corpus_small_cap_is_fast_and_deterministic():
    a = load_corpus(BUILTIN, max_bytes=400_000)
    b = load_corpus(BUILTIN, max_bytes=400_000)
    assert a.source == BUILTIN and a.n_files > 100
    assert a.eval.size >= 1024 and a.train.size >= 8192
    assert a.train.size + a.eval.size < 600_000
    assert np.array_equal(a.train, b.train) and np.array_equal(a.eval, b.eval)
    assert b"def " in a.train.tobytes()  # Python sources
    # held out by file: a long run of eval bytes never appears in the train split
    probe = a.eval[: min(400, a.eval.size)].tobytes()
    assert probe not in a.train.tobytes()


def test_builtin_corpus_at_the_smallest_cap_run_config_allows():
    # Below ~20 files the every-20th hold-out would read no eval file; the loader skips ahead to one.
    c = load_corpus(BUILTIN, max_bytes=1 << 16)
    assert c.eval.size > 0 and c.train.size >= 1 << 16


def test_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="max_bytes must be at least 4096"):
        load_corpus(BUILTIN, max_bytes=4095)
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 8191)
    with pytest.raises(ValueError, match="too small"):
        load_corpus(str(small))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.bin").write_bytes(b"x" * 10_000)
    with pytest.raises(ValueError, match="holds no text files"):
        load_corpus(str(empty))
    few = write_files(tmp_path / "few", 10, size=2000)  # 20 KB, but no 20th file to hold out
    with pytest.raises(ValueError, match="too small to train on"):
        load_corpus(str(few))


def test_cut_shards():
    tokens = np.arange(1000, dtype=np.uint16)
    shards = cut_shards(tokens, 300)
    assert [s.size for s in shards] == [300, 300, 300]  # ragged tail dropped
    assert np.array_equal(np.concatenate(shards), tokens[:900])
    assert len(cut_shards(tokens, 1000)) == 1 and len(cut_shards(tokens, 2)) == 500
    with pytest.raises(ValueError, match="smaller than one shard"):
        cut_shards(tokens, 1001)
    with pytest.raises(ValueError, match="at least 2"):
        cut_shards(tokens, 1)


def test_cut_shards_shuffled_by_a_seed():
    tokens = np.arange(10_000, dtype=np.uint16)
    plain = cut_shards(tokens, 100)
    shuffled = cut_shards(tokens, 100, shuffle_seed=7)
    firsts = [int(s[0]) for s in shuffled]
    assert sorted(firsts) == [int(s[0]) for s in plain]  # the same pieces, each whole
    assert all(np.array_equal(s, tokens[s[0]:s[0] + 100]) for s in shuffled)
    assert firsts != sorted(firsts)
    assert [int(s[0]) for s in cut_shards(tokens, 100, shuffle_seed=7)] == firsts  # same seed, same order
    assert [int(s[0]) for s in cut_shards(tokens, 100, shuffle_seed=8)] != firsts
    # neighbours in the corpus rarely stay neighbours: adjacent indices hold far-apart pieces
    gaps = np.abs(np.diff(firsts)) // 100
    assert np.median(gaps) > 10


def test_sample_batch():
    tokens = torch.arange(500) % 256
    x, y = sample_batch(tokens.to(torch.uint8), batch_size=7, context=16,
                        generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (7, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])  # targets are the inputs shifted by one
    assert torch.equal(y[:, -1], (x[:, -1] + 1) % 256)  # ...and the token after the window
    assert torch.all((x[:, 1:] - x[:, :-1]) % 256 == 1)  # every row is a contiguous window
    x2, _ = sample_batch(tokens.to(torch.uint8), batch_size=7, context=16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)


def test_sample_batch_covers_the_last_window_and_refuses_short_shards():
    tokens = torch.arange(18, dtype=torch.uint8)  # windows of 17: starts 0 and 1 only
    x, y = sample_batch(tokens, batch_size=64, context=16, generator=torch.Generator().manual_seed(1))
    assert set(x[:, 0].tolist()) == {0, 1} and y.max() == 17
    with pytest.raises(ValueError, match="shorter than context\\+1 = 17"):
        sample_batch(tokens[:16], batch_size=1, context=16, generator=torch.Generator())


def test_sha256_hex():
    arr = np.frombuffer(b"abc", dtype=np.uint8)
    assert sha256_hex(arr) == sha256_hex(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
