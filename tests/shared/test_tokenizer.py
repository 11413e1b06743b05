"""shared/tokenizer.py: the bytes and BPE tokenizers, their JSON and hash."""

from __future__ import annotations

import random
import re
import subprocess
import sys

import numpy as np
import pytest

from shared.data import load_corpus
from shared.tokenizer import EOT, Tokenizer, bytes_tokenizer, from_served, max_json_bytes, token_dtype, train_bpe

TEXTS = ["héllo wörld\n\tend 🙂", "", "a", "x" * 3000, "\x00\x01 control\r\n", "日本語のテキスト",
         "def f(x):\n    return x ** 2  # squares\n"]


def _corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "the model learns from bytes while idle machines train one shared network über café".split()
    words += ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) + "\n" for _ in range(n)]


def test_bytes_tokenizer_ids_are_the_raw_bytes():
    tok = bytes_tokenizer()
    assert (tok.kind, tok.vocab_size, tok.dtype, tok.eot_id) == ("bytes", 256, "uint8", None)
    for text in TEXTS:
        assert tok.encode(text) == list(text.encode("utf-8"))
        assert tok.decode(tok.encode(text)) == text
    every_byte = bytes(range(256))
    assert tok.decode(list(every_byte)) == every_byte.decode("utf-8", errors="replace")


def test_bytes_tokenizer_matches_the_raw_corpus_path(tmp_path):
    """shared/data.py's byte path (a raw corpus file) and the bytes tokenizer give the same ids."""
    text = "".join(_corpus(300))
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path))
    ids = np.asarray(bytes_tokenizer().encode(text), dtype=np.uint8)
    assert np.array_equal(np.concatenate([corpus.train, corpus.eval]), ids)


def test_invalid_utf8_decodes_without_error():
    tok = bytes_tokenizer()
    assert tok.decode([0xFF, 0xFE, 65]) == "\ufffd\ufffdA"
    assert tok.decode([0xC3]) == "\ufffd"  # a multi-byte character cut in half


def test_bpe_round_trip_and_eot():
    docs = _corpus()
    tok = train_bpe(iter(docs), 400)
    assert (tok.kind, tok.vocab_size, tok.dtype) == ("bpe", 400, "uint16")
    assert train_bpe(iter(["tiny corpus"]), 400).vocab_size < 400  # no more merges to make: fewer tokens
    assert tok.eot_id is not None and tok.decode([tok.eot_id]) == EOT
    for text in TEXTS + docs[:20]:
        assert tok.decode(tok.encode(text)) == text
    # BPE compresses what it was trained on: fewer tokens than bytes
    sample = "".join(docs[:50])
    assert len(tok.encode(sample)) < 0.6 * len(sample.encode())
    joined = tok.encode(docs[0]) + [tok.eot_id] + tok.encode(docs[1])
    assert tok.decode(joined) == docs[0] + EOT + docs[1]
    assert tok.encode_batch(docs[:5]) == [tok.encode(d) for d in docs[:5]]


def test_bpe_training_is_deterministic_and_from_a_generator():
    a = train_bpe((d for d in _corpus()), 350)
    b = train_bpe((d for d in _corpus()), 350)
    assert a.sha256 == b.sha256 and a.to_json() == b.to_json()


@pytest.mark.parametrize("make", [bytes_tokenizer, lambda: train_bpe(iter(_corpus()), 300)],
                         ids=["bytes", "bpe"])
def test_json_and_file_round_trips_give_identical_ids(make, tmp_path):
    tok = make()
    again = Tokenizer.from_json(tok.to_json())
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    from_file = Tokenizer.from_file(path)
    for other in (again, from_file):
        assert (other.sha256, other.kind, other.vocab_size) == (tok.sha256, tok.kind, tok.vocab_size)
        for text in TEXTS:
            assert other.encode(text) == tok.encode(text)


def test_the_hash_is_stable_across_processes():
    code = "from shared.tokenizer import bytes_tokenizer; print(bytes_tokenizer().sha256)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == bytes_tokenizer().sha256


def test_bad_inputs_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="between 257"):
        train_bpe(iter(["abc"]), 100)
    with pytest.raises(ValueError, match="cannot be read"):
        Tokenizer.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizers JSON"):
        Tokenizer.from_file(bad)


def test_token_dtype():
    assert token_dtype(256, kind="bytes") == "uint8"
    assert token_dtype(256) == "uint16"
    assert token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "uint32"


def test_a_vocab_above_65536_loads_with_uint32_ids():
    """A tokenizer.json the operator brings, with ids above 65,535 (WordLevel keeps it fast)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    inner = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = Tokenizer.from_json(inner.to_str())
    assert (tok.kind, tok.vocab_size, tok.dtype) == ("bpe", 70_000, "uint32")
    assert tok.encode("w69999 w1 w65536") == [69999, 1, 65536]


def test_transformers_loads_both(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                                               "'idletrain[test]')")
    for tok in (bytes_tokenizer(), train_bpe(iter(_corpus()), 300)):
        tok.save(tmp_path / "tokenizer.json")
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
        text = "héllo the model 🙂"
        assert hf(text)["input_ids"] == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text


def test_a_served_tokenizer_of_the_runs_vocab_is_taken():
    bpe = train_bpe(iter(_corpus()), 400)
    served = from_served(bpe.to_json().encode(), vocab_size=bpe.vocab_size, source="t")
    assert served.sha256 == bpe.sha256 and served.encode("the model") == bpe.encode("the model")
    assert from_served(bytes_tokenizer().to_json().encode(), vocab_size=8192, source="t").kind == "bytes"


def test_real_tokenizers_weigh_well_under_the_cap():
    """Trained BPEs measured 17 to 33 bytes a token (vocab 512 to 65,536): the cap allows 256 and 1 MiB."""
    for vocab in (300, 2000):
        tok = train_bpe(iter(_corpus(2000)), vocab)
        assert len(tok.to_json().encode()) < max_json_bytes(tok.vocab_size) // 4


@pytest.mark.parametrize("body, says", [
    (b"x" * (max_json_bytes(256) + 1), "over the 1,114,112 a tokenizer of 256 tokens can weigh"),
    (b"\xff\xfe not utf-8", "not UTF-8 JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "not UTF-8 JSON"),
    (b'{"model": {"type": "Pickle"}}', "not a tokenizers file"),
    (b'["a list"]', "not a tokenizers file"),
    (b'{"model": {"type": "BPE", "vocab": {}, "merges": [' + b",".join([b'"a b"'] * 300) + b"]}}",
     "300 entries in its merges, more than the model's vocab of 256"),
    (b'{"model": {"type": "BPE", "vocab": {}}, "added_tokens": [' + b",".join([b"{}"] * 257) + b"]}",
     "257 entries in its added tokens"),
    (b'{"model": {"type": "BPE", "vocab": "x"}}', "is not a tokenizers JSON file"),
])
def test_a_served_tokenizer_out_of_form_is_refused_saying_why(body, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        from_served(body, vocab_size=256, source="run 't''s tokenizer")


def test_a_served_tokenizer_of_another_vocab_is_refused():
    bpe = train_bpe(iter(_corpus()), 400)
    with pytest.raises(ValueError, match=f"has {bpe.vocab_size} tokens .*the run's model 512"):
        from_served(bpe.to_json().encode(), vocab_size=512, source="t")
    with pytest.raises(ValueError, match="256 entries in its vocab, more than the model's vocab of 128"):
        from_served(bytes_tokenizer().to_json().encode(), vocab_size=128, source="t")
