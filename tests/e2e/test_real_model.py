"""A real model end to end over real sockets on 127.0.0.1, the way README's "Train a real model"
does it, every step a `python -m idletrain` process: `data prepare` turns a .jsonl corpus into BPE
token shards, `coordinator serve` serves them, `run create --data` starts a Llama-style run, two
`worker run` processes train it (the held-out loss must fall), `export --format hf` writes a folder
that transformers loads and generates from, and `sample` prints text through the run's tokenizer.

transformers is the independent reference: its LlamaForCausalLM, loaded from the exported folder,
must compute the logits our model computes from the same version (exported as .safetensors)."""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from idletrain.harness import free_port
from tests import procs

ROUNDS = 4  # per worker
WORKERS = 2
STEPS, BATCH, CONTEXT = 20, 8, 64
VOCAB = 512  # asked for; the run uses what the corpus gave (the manifest's vocab_size)
PROMPT = "The worker"

_SUBJECTS = ("the worker", "a volunteer", "the coordinator", "each machine", "the model", "our laptop",
             "a small desktop", "the merger")
_VERBS = ("trains", "downloads", "uploads", "merges", "compresses", "evaluates", "leases", "caches")
_OBJECTS = ("a shard of text", "the latest weights", "a sparse delta", "the held-out split", "one round of steps",
            "the tokenizer file", "a quantised update")
_TAILS = ("over plain http.", "while nobody is using it.", "before the lease expires.", "in a few seconds.",
          "and then waits.", "with error feedback.")


def write_jsonl(path: Path, n_records: int = 600, seed: int = 0) -> set[str]:
    """`n_records` JSON lines {"id", "text"} of sentences from a small grammar (~200 KB); the corpus's words."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for i in range(n_records):
            text = " ".join(f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                            f"{rng.choice(_TAILS)}" for _ in range(rng.randint(3, 8)))
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return set(_words(" ".join(_SUBJECTS + _VERBS + _OBJECTS + _TAILS)))


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z-]+", text.lower())


def _run(tmp_path: Path, *args: str, timeout: float = 120) -> str:
    """`python -m idletrain ARGS` to completion; its stdout (the test fails with its output if it fails)."""
    done = subprocess.run([sys.executable, "-m", "idletrain", *args], env=procs.env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"idletrain {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_bpe_llama_run_over_loopback_exports_to_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported: nothing downloads
    transformers = pytest.importorskip("transformers", reason="pip install 'idletrain[hf]'")
    import safetensors.torch
    import torch

    from shared.model import ModelConfig, build_model, set_params

    corpora = tmp_path / "corpora"
    corpora.mkdir()
    vocabulary = write_jsonl(tmp_path / "corpus.jsonl")
    prepared = corpora / "prepared"
    summary = json.loads(_run(tmp_path, "data", "prepare", str(tmp_path / "corpus.jsonl"), "--out", str(prepared),
                              "--tokenizer", "bpe", "--vocab-size", str(VOCAB), "--text-field", "text",
                              "--shard-tokens", "4096", "--eval-tokens", "4096", "--json", "--quiet"))
    vocab = summary["vocab_size"]
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert summary["tokenizer"] == "bpe" and 256 < vocab <= VOCAB and manifest["tokenizer"]["vocab_size"] == vocab
    assert summary["train_tokens"] >= 8 * 4096 and summary["eval_tokens"] == 4096

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data_dir = tmp_path / "data"
    running = procs.Idletrain(tmp_path)
    logs, spawn = running.logs, running.spawn

    try:
        coord = spawn("coordinator", "--log-level", "WARNING", "coordinator", "serve", "--host", "127.0.0.1",
                      "--port", str(port), "--data-dir", str(data_dir), "--corpus-dir", str(corpora))
        with httpx.Client(base_url=url, timeout=120) as client:
            procs.wait_healthy(client, coord, logs / "coordinator.log")
            client.headers.update(procs.admin_headers(data_dir))  # this client is the operator's only
            _run(tmp_path, "run", "create", "real", "--coordinator", url, "--data-dir", str(data_dir),
                 "--data", str(prepared), "--arch", "llama", "--vocab-size", str(vocab), "--n-layer", "2",
                 "--d-model", "64", "--n-head", "4", "--context", str(CONTEXT), "--shard-tokens", "4096",
                 "--eval-tokens", "4096", "--eval-every", "2", "--steps", str(STEPS), "--batch-size", str(BATCH),
                 "--lr", "3e-3", "--group", str(WORKERS), "--epochs", "0")
            cfg = client.get("/api/v1/runs/real/config").json()
            assert cfg["model"]["arch"] == "llama" and cfg["model"]["vocab_size"] == vocab, cfg["model"]
            # the tokenizer workers fetch is the prepared one, byte for byte
            tok_resp = client.get("/api/v1/runs/real/tokenizer")
            assert tok_resp.status_code == 200, tok_resp.text
            assert hashlib.sha256(tok_resp.content).hexdigest() == manifest["tokenizer"]["sha256"]
            assert tok_resp.content == (prepared / manifest["tokenizer"]["file"]).read_bytes()

            running.train(url, "real", workers=WORKERS, rounds=ROUNDS)

            acknowledged = WORKERS * ROUNDS
            procs.wait_merged(client, "real", acknowledged, log=logs / "coordinator.log")
            final = client.post("/api/v1/runs/real/evaluate")
            assert final.status_code == 200, final.text
            st = client.get("/api/v1/runs/real/status").json()
            assert st["merged_deltas"] == acknowledged and st["rejected_deltas"] == 0, st
            assert st["tokens_trained"] == acknowledged * STEPS * BATCH * CONTEXT
            losses = [e["loss"] for e in st["eval_history"]]
            print("eval losses", [(e["version"], round(e["loss"], 3)) for e in st["eval_history"]])
            # version 0 sits near ln(vocab) (~6.2 nats/token); the grammar's text is learnable well below it
            assert losses[0] > 5.0, losses
            assert final.json()["loss"] < losses[0] - 2.0, (losses, final.json())

            hf_dir = tmp_path / "real-hf"
            _run(tmp_path, "export", str(hf_dir), "--run", "real", "--format", "hf", "--coordinator", url)
            ours_file = tmp_path / "real.safetensors"
            _run(tmp_path, "export", str(ours_file), "--run", "real", "--coordinator", url)
            sampled = _run(tmp_path, "sample", "--run", "real", "--coordinator", url, "--prompt", PROMPT,
                           "--tokens", "24", "--temperature", "0")
            assert coord.poll() is None, procs.tail(logs / "coordinator.log")
    finally:
        running.close()

    # `sample`: text through the run's BPE, in the corpus's words (an untrained model strings random pieces)
    assert sampled.startswith(PROMPT), sampled
    words = _words(sampled)
    assert len(words) >= 6 and sum(w in vocabulary for w in words) >= 0.6 * len(words), sampled

    # transformers, offline, loads the folder and generates
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in hf_dir.iterdir()}
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    prompt = hf_tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model.generate(prompt, max_new_tokens=16, do_sample=False)
    new_ids = out[0, prompt.shape[1]:].tolist()
    assert len(new_ids) == 16 and all(0 <= t < vocab for t in new_ids)
    text = hf_tok.decode(out[0], skip_special_tokens=True)
    print("transformers:", repr(text))
    assert text.startswith(PROMPT) and len(text) > len(PROMPT) + 10, text
    words = _words(text)
    assert sum(w in vocabulary for w in words) >= 0.6 * len(words), text

    # ...computing what our model computes from the same version
    tensors = safetensors.torch.load_file(str(ours_file))
    with ours_file.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    model = build_model(ModelConfig.from_dict(json.loads(header["__metadata__"]["model"])))
    set_params(model, tensors)
    model.eval()
    with torch.no_grad():
        ours = model(out)
        ours = ours[0] if isinstance(ours, tuple) else ours
        theirs = hf_model(out).logits
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
