"""`python -m bench models` at a tiny size: the bits-per-byte arithmetic against hand computations, and
a whole run on a corpus made here writing its four rows, results.md and the plot."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.__main__ import main
from bench.models import (Profile, bits_per_byte, eval_set, evaluate_bpb, matched_ffn, model_config,
                          non_embedding_params, run)
from shared.model import build_model
from shared.tokenizer import token_byte_lengths, train_bpe

WORDS = ["def", "return", "self", "value", "for", "in", "range", "import", "numpy", "as", "np", "if", "else",
         "café", "naïve", "größe", "東京", "λ", "print", "(", ")", ":", "=", "+", "\n", "    "]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def test_bits_per_byte_is_nats_per_token_times_tokens_over_bytes_over_ln2():
    # 2 nats on each of 10 tokens = 20 nats = 20 / ln 2 bits, spread over 25 bytes
    assert bits_per_byte(2.0, 10, 25) == pytest.approx(20 / math.log(2) / 25)
    assert bits_per_byte(math.log(2), 7, 7) == pytest.approx(1.0)  # byte tokens: bits per byte = nats / ln 2
    assert bits_per_byte(1.0, 4, 12) == pytest.approx(0.4808983469629878)  # 4 / 12 / 0.693147...


def test_eval_set_counts_the_windows_targets_and_their_bytes():
    lengths = np.array([1, 2, 3, 4, 5, 6, 7, 8])
    es = eval_set([0, 1, 2, 3, 4, 5, 6, 7], lengths, context=3)
    # (8 - 1) // 3 = 2 windows, targets ids[1:7] = 1..6, bytes 2+3+4+5+6+7
    assert (es.target_tokens, es.target_bytes) == (6, 27)
    with pytest.raises(ValueError, match="fewer than one window"):
        eval_set([0, 1, 2], lengths, context=3)


def test_evaluate_bpb_matches_a_loss_summed_by_hand_over_the_decoded_bytes():
    rng = random.Random(0)
    tok = train_bpe([_text(rng, 400) for _ in range(20)], 300)
    text = "def main():\n" + _text(rng, 300) + "\n" + "x = 1\n" * 60  # multi-byte text inside, ASCII at the ends
    ids = tok.encode(text)
    context = 8
    es = eval_set(ids, token_byte_lengths(tok), context)
    model = build_model(model_config(_tiny(), "llama", tok.vocab_size, context), seed=3)
    nats, bpb = evaluate_bpb(model, es)
    n_seq = (len(ids) - 1) // context
    total_nats = 0.0
    with torch.no_grad():
        for s in range(n_seq):
            window = torch.tensor(ids[s * context:(s + 1) * context + 1])
            logits, _ = model(window[None, :-1])
            total_nats += float(F.cross_entropy(logits[0], window[1:], reduction="sum"))
    # the target bytes: all the text the first n_seq * context + 1 tokens decode to, less the first token's
    covered = len(tok.decode(ids[:n_seq * context + 1]).encode()) - len(tok.decode(ids[:1]).encode())
    assert covered == es.target_bytes
    assert nats == pytest.approx(total_nats / (n_seq * context), rel=1e-5)
    assert bpb == pytest.approx(total_nats / covered / math.log(2), rel=1e-5)


def test_the_llama_swiglu_width_matches_the_gpt_block():
    p = _tiny(d_model=128)
    assert matched_ffn(128) == 344
    gpt, llama = (build_model(model_config(p, arch, 256, 32)) for arch in ("gpt", "llama"))
    assert abs(non_embedding_params(llama) / non_embedding_params(gpt) - 1) < 0.01
    # the GPT's non-embedding parameters: 12 d^2 + 13 d per block, and the final LayerNorm's 2 d
    assert non_embedding_params(gpt) == p.n_layer * (12 * 128 ** 2 + 13 * 128) + 2 * 128


def _tiny(d_model: int = 16) -> Profile:
    return Profile(d_model=d_model, n_layer=1, n_head=2, context_bytes=48, batch_size=4, steps=10, lrs=(3e-3, 1e-2),
                   warmup_steps=2, vocab_size=300, corpus_max_bytes=1 << 20, val_bytes=1500, test_bytes=3000,
                   eval_every=5)


def test_a_tiny_run_writes_four_rows_on_the_same_bytes_and_a_plot(tmp_path):
    rng = random.Random(1)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):  # every 20th file is held out: 3 files, ~6 KB
        (corpus / f"f{i:02d}.py").write_text(_text(rng, 400), encoding="utf-8")
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    try:
        result = run(profile=_tiny(), out=out, source=str(corpus), threads=1)
    finally:
        torch.set_num_threads(threads)
    assert {f.name for f in out.iterdir()} == {"results.json", "results.md", "bpb.png"}
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["row"] for r in rows] == ["bytes + GPT", "bytes + Llama", "bpe + GPT", "bpe + Llama"]
    meta = result["meta"]
    assert meta["bpe_bytes_per_token"] > 1.5 and meta["bpe_context"] == round(48 / meta["bpe_bytes_per_token"])
    for r in rows:
        assert abs(r["train_bytes_seen"] / meta["train_bytes_seen"] - 1) < 0.1, r["row"]  # the same text seen
        assert 0 < r["test_bpb"] < 8.5 and len(r["curve"]) == 2 and r["curve"][-1][1] == r["val_bpb"]
        assert r["lr"] == min(r["lr_sweep"], key=lambda s: s["val_bpb"])["lr"]
        if r["tokenizer"] == "bytes":  # one byte per token: bits per byte is nats per token / ln 2
            assert r["test_bpb"] == pytest.approx(r["test_nats_per_token"] / math.log(2), rel=1e-3)
            assert r["test_tokens"] == r["test_bytes"]
    table = (out / "results.md").read_text()
    assert all(f"| {r['row']} | {r['test_bpb']:.3f} |" in table for r in rows)


def test_the_command_refuses_an_unknown_profile(capsys):
    assert main(["models", "--profile", "huge"]) != 0
    assert "unknown profile 'huge'" in capsys.readouterr().err
