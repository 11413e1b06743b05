"""Runs on prepared data (`run create --data DIR`): the manifest checked against the run, shards cut
from the memory-mapped files exactly as cut_shards would cut the whole, leases that name the token
dtype and the tokenizer, GET /tokenizer with its ETag, and a worker that decodes uint16 and uint32
shards and caches the tokenizer once. On SQLite and PostgreSQL (the `api` fixtures)."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from coordinator.settings import CoordinatorSettings
from shared import protocol
from shared.data import cut_shards
from shared.dataset import open_tokens, prepare, read_manifest
from shared.tokenizer import Tokenizer, bytes_tokenizer
from tests.conftest import _WORDS, TINY_MODEL
from tests.worker.test_incremental_download import MergingTransport
from tests.worker.test_resume import URL
from worker.client import CoordinatorClient
from worker.loop import Worker
from worker.settings import WorkerSettings

API = protocol.API_PREFIX


def _text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """Two prepared folders: a BPE of 300 tokens (uint16) and a 70,000-word tokenizer (uint32)."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "src.txt").write_text(_text(30_000, 0))
    prepare(root / "src.txt", root / "bpe", tokenizer="bpe", vocab_size=300, shard_tokens=5000, eval_tokens=3000)
    inner = tokenizers.Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.save(str(root / "words.json"))
    rng = random.Random(1)
    (root / "words.txt").write_text(" ".join(f"w{rng.randrange(70_000)}" for _ in range(12_000)))
    prepare(root / "words.txt", root / "wide", tokenizer=str(root / "words.json"), shard_tokens=4096,
            eval_tokens=2048)
    return root


@pytest.fixture
def data_api(open_api, tmp_path, data_root):
    settings = CoordinatorSettings(data_dir=tmp_path / "coordinator", corpus_dirs=[data_root],
                                   allowed_hosts=["coordinator.test"])  # the in-process worker's name for it
    with open_api(settings) as a:
        yield a


def _config(folder: Path, vocab: int, **extra) -> dict:
    return {"name": "t", "data": str(folder), "shard_tokens": 1024, "eval_tokens": 1024, "seed": 7,
            "model": {**TINY_MODEL, "context": 16, "vocab_size": vocab}, "inner": {"steps": 2, "batch_size": 2},
            "outer": {"group": 1}, **extra}


def _train_ids(folder: Path) -> np.ndarray:
    m = read_manifest(folder)
    return np.concatenate([open_tokens(folder, s, m.dtype) for s in m.shards])


@pytest.mark.parametrize("name, dtype", [("bpe", "<u2"), ("wide", "<u4")])
def test_a_run_on_prepared_data_serves_its_shards(data_api, data_root, name, dtype):
    folder = data_root / name
    m = read_manifest(folder)
    created = data_api.create_run(_config(folder, m.tokenizer.vocab_size))
    expected = cut_shards(_train_ids(folder), 1024, shuffle_seed=7)  # the whole read at once: the reference
    assert (created["n_shards"], created["train_tokens"]) == (len(expected), 1024 * len(expected))
    assert created["unused_tokens"] == m.train_tokens - 1024 * len(expected) > 0  # said, not silently dropped
    assert created["eval_tokens"] == m.eval.n_tokens
    headers = data_api.register()
    lease = data_api.lease(headers)
    assert (lease.token_dtype, lease.tokenizer_sha256) == (m.dtype, m.tokenizer.sha256)
    for i, want in enumerate(expected):
        got = np.frombuffer(data_api.shard(i, headers), dtype=dtype)
        assert np.array_equal(got, want), i
    raw = data_api.shard(lease.shard_id, headers)
    assert hashlib.sha256(raw).hexdigest() == lease.shard_sha256
    # the coordinator evaluates on the held-out ids, decoded with the run's dtype
    held = np.asarray(open_tokens(folder, m.eval, m.dtype))
    assert np.array_equal(data_api.runtime().eval_tokens().numpy(), held[:1024])
    public = data_api.client.get(f"{API}/runs/t/config").json()
    assert "data" not in public and public["tokens"]["dtype"] == m.dtype  # no path on the coordinator's disk
    assert data_api.status()["eval_loss"] == pytest.approx(np.log(m.tokenizer.vocab_size), rel=0.1)


def test_the_tokenizer_route(data_api, data_root):
    folder = data_root / "bpe"
    m = read_manifest(folder)
    data_api.create_run(_config(folder, m.tokenizer.vocab_size))
    resp = data_api.client.get(f"{API}/runs/t/tokenizer")
    assert resp.status_code == 200
    assert resp.content == (folder / "tokenizer.json").read_bytes()
    assert resp.headers["ETag"] == f'"{m.tokenizer.sha256}"'
    assert resp.headers[protocol.H_SHA256] == m.tokenizer.sha256
    assert "immutable" in resp.headers["Cache-Control"]
    assert Tokenizer.from_json(resp.text).sha256 == m.tokenizer.sha256
    again = data_api.client.get(f"{API}/runs/t/tokenizer", headers={"If-None-Match": resp.headers["ETag"]})
    assert (again.status_code, again.content) == (304, b"")
    assert data_api.client.get(f"{API}/runs/nope/tokenizer").status_code == 404


def test_a_raw_corpus_run_gets_the_bytes_tokenizer(api, run_config):
    api.create_run(run_config())
    lease = api.lease(api.register())
    bytes_sha = bytes_tokenizer().sha256
    assert (lease.token_dtype, lease.tokenizer_sha256) == ("uint8", bytes_sha)
    resp = api.client.get(f"{API}/runs/t/tokenizer")
    assert resp.status_code == 200 and resp.headers["ETag"] == f'"{bytes_sha}"'
    assert Tokenizer.from_json(resp.text).kind == "bytes"


def test_refusals_say_what_to_do(data_api, data_root, tmp_path):
    folder = data_root / "bpe"
    vocab = read_manifest(folder).tokenizer.vocab_size

    def refused(cfg: dict) -> str:
        resp = data_api.client.post(f"{API}/runs", json=cfg, headers=data_api.admin)
        assert resp.status_code == 422, resp.text
        return json.dumps(resp.json())

    msg = refused(_config(folder, 256))
    assert f"vocab_size is 256 but the data's tokenizer has {vocab} tokens" in msg
    assert f"--vocab-size) to {vocab}" in msg
    assert "outside the folders" in refused(_config(tmp_path, vocab))
    assert "manifest.json cannot be read" in refused(_config(data_root, vocab))
    assert "not both" in refused({**_config(folder, vocab), "corpus": str(folder)})
    assert "fewer than one shard" in refused({**_config(folder, vocab), "shard_tokens": 1 << 22})
    assert data_api.client.get(f"{API}/runs/t/status").status_code == 404  # nothing was created


def test_a_damaged_shard_is_refused(open_api, tmp_path, data_root):
    folder = tmp_path / "allowed" / "copy"
    shutil.copytree(data_root / "bpe", folder)
    shard = folder / "shards" / "000001.bin"
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 1
    shard.write_bytes(bytes(raw))
    settings = CoordinatorSettings(data_dir=tmp_path / "coordinator", corpus_dirs=[tmp_path / "allowed"])
    with open_api(settings) as a:
        resp = a.client.post(f"{API}/runs", json=_config(folder, read_manifest(folder).tokenizer.vocab_size),
                             headers=a.admin)
    assert resp.status_code == 422 and "000001.bin does not match the manifest's SHA-256" in resp.text


@pytest.mark.parametrize("name", ["bpe", "wide"])
def test_a_worker_trains_on_prepared_data(data_api, data_root, tmp_path, name):
    """A real worker (in process, through the app): its shards decode to the ids the coordinator cut,
    and it fetches the tokenizer once, into its cache by hash."""
    folder = data_root / name
    m = read_manifest(folder)
    data_api.create_run(_config(folder, m.tokenizer.vocab_size))
    transport = MergingTransport(data_api)
    settings = WorkerSettings(coordinator=URL, run="t", state_dir=tmp_path / "worker", device="cpu", max_rounds=2)
    worker = Worker(settings, client=CoordinatorClient(URL, transport=transport, max_retries=2))
    worker.lease_ahead = False
    assert worker.run() == 2
    assert [p for meth, p in transport.log if p.endswith("/tokenizer")] == [f"{API}/runs/t/tokenizer"]
    cached = tmp_path / "worker" / "cache" / "tokenizers" / f"{m.tokenizer.sha256}.json"
    assert cached.read_bytes() == (folder / "tokenizer.json").read_bytes()
    expected = cut_shards(_train_ids(folder), 1024, shuffle_seed=7)
    lease = data_api.lease(data_api.register())
    tokens = worker.downloads.tokens(lease)
    assert tokens.dtype.is_signed and np.array_equal(tokens.numpy(), expected[lease.shard_id])
    assert data_api.status()["merged_deltas"] == 2
