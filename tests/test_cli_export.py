"""`idletrain export` (the trained model as .safetensors, or a Hugging Face folder that transformers
loads) and `idletrain sample` (text from it, through the run's tokenizer)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch

from coordinator.settings import CoordinatorSettings
from idletrain import cli
from idletrain import export
from shared.model import ModelConfig, build_model, generate, generate_ids, get_params, param_schema, set_params
from shared.snapshot import decode_snapshot
from shared.dataset import prepare
from shared.tokenizer import EOT, Tokenizer, bytes_tokenizer, train_bpe

URL = "http://coordinator.test"


@contextlib.contextmanager
def serving(open_api, tmp_path, config: dict, make_delta, monkeypatch, *, corpus_dirs=()):
    """A coordinator (in process) with `config`'s run after two merged deltas, answering httpx's calls."""
    with open_api(CoordinatorSettings(data_dir=tmp_path / "coord", corpus_dirs=list(corpus_dirs))) as api:
        api.create_run(config)
        w = api.register()
        for seed in (1, 2):
            lease = api.lease(w)
            api.accept(lease.lease_id, make_delta(lease, seed=seed), w)
        api.drain()

        def request(method, url, *, timeout, headers=None):
            assert url.startswith(URL)
            return api.client.request(method, url[len(URL):], headers=headers or {})

        monkeypatch.setattr(httpx, "request", request)
        monkeypatch.setattr(httpx, "get", lambda url, timeout: request("GET", url, timeout=timeout))
        yield api


@pytest.fixture
def api(tmp_path, open_api, run_config, make_delta, monkeypatch):
    with serving(open_api, tmp_path, run_config(), make_delta, monkeypatch) as api:
        yield api


def test_export_writes_the_latest_model(api, tmp_path, capsys):
    out = tmp_path / "m" / "model.safetensors"
    assert cli.main(["export", str(out), "--run", "t", "--coordinator", URL]) == 0
    assert "version 2" in capsys.readouterr().out
    with safetensors.safe_open(str(out), "pt") as f:
        meta = f.metadata()
        params = {k: f.get_tensor(k) for k in f.keys()}
    assert meta["run"] == "t" and meta["version"] == "2"
    cfg = ModelConfig.from_dict(json.loads(meta["model"]))
    latest, _ = decode_snapshot(api.snapshot("latest"), schema=param_schema(build_model(cfg)))
    assert set(params) == set(latest) and all(torch.equal(params[n], latest[n]) for n in params)
    # the file is all one needs to rebuild the model
    set_params(build_model(cfg), params)


def test_export_an_older_version_and_refusals(api, tmp_path, capsys):
    out = tmp_path / "v1.safetensors"
    assert cli.main(["export", str(out), "--run", "t", "--version", "1", "--coordinator", URL]) == 0
    with safetensors.safe_open(str(out), "pt") as f:
        assert f.metadata()["version"] == "1"
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "x.pt"), "--run", "t", "--coordinator", URL]) == 2
    assert ".safetensors" in capsys.readouterr().err
    assert cli.main(["export", str(out), "--run", "t", "--version", "99", "--coordinator", URL]) == 2
    assert "404" in capsys.readouterr().err
    assert cli.main(["export", str(out), "--run", "nope", "--coordinator", URL]) == 2
    assert "no run named 'nope'" in capsys.readouterr().err


def test_sample_continues_the_prompt_reproducibly(api, capsys):
    argv = ["sample", "--run", "t", "--prompt", "import ", "--tokens", "40", "--seed", "3", "--coordinator", URL]
    assert cli.main(argv) == 0
    first = capsys.readouterr()
    assert first.out.startswith("import ") and "version 2" in first.err
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == first.out  # same seed, same text
    assert cli.main([*argv[:-2], "--tokens", "0", "--coordinator", URL]) == 2
    assert "--tokens" in capsys.readouterr().err


def test_generate_greedy_and_sampled():
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=32, context=16)
    model = build_model(cfg, seed=1)
    greedy = generate(model, b"hello", max_new_tokens=40, temperature=0)
    assert len(greedy) == 40 and greedy == generate(model, b"hello", max_new_tokens=40, temperature=0)
    g = torch.Generator().manual_seed(0)
    sampled = generate(model, b"", max_new_tokens=20, generator=g, top_k=1)
    assert len(sampled) == 20
    with pytest.raises(ValueError):
        generate(model, b"x", max_new_tokens=-1)


# -- a Hugging Face folder (--format hf), loaded by transformers ------------------------------------

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads: every folder below is written here
HF_REASON = "pip install 'idletrain[test]' (transformers)"


def _ours(api, out: Path) -> tuple[torch.nn.Module, ModelConfig]:
    """Our model at the exported version, rebuilt from the coordinator's snapshot."""
    with safetensors.safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    cfg = ModelConfig.from_dict(json.loads(meta["model"]))
    params, _ = decode_snapshot(api.snapshot(meta["version"]), schema=param_schema(build_model(cfg)))
    model = build_model(cfg)
    set_params(model, params)
    return model.eval(), cfg


@pytest.mark.parametrize("model,hf_class", [
    ({}, "GPT2LMHeadModel"),  # our GPT is GPT-2's function with exact GELU
    ({"arch": "llama", "n_kv_head": 1, "tie_embeddings": False}, "LlamaForCausalLM"),
    ({"arch": "llama"}, "LlamaForCausalLM"),
])
def test_export_hf_folder_loads_in_transformers_and_computes_our_logits(
        model, hf_class, tmp_path, open_api, run_config, make_delta, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers", reason=HF_REASON)
    with serving(open_api, tmp_path, run_config(model=model), make_delta, monkeypatch) as api:
        out = tmp_path / "hf"
        assert cli.main(["export", str(out), "--format", "hf", "--run", "t", "--coordinator", URL]) == 0
        assert hf_class in capsys.readouterr().out
        ours, cfg = _ours(api, out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in out.iterdir()}
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert type(hf).__name__ == hf_class
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=idx).logits, ours(idx)[0], rtol=1e-5, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def héllo():"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode())  # the run's tokenizer: bytes
    new = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert new.tolist() == generate_ids(ours, ids, max_new_tokens=10, temperature=0)
    assert isinstance(tok.decode(new), str) and len(new) == 10


@pytest.mark.parametrize("model", [{}, {"arch": "llama", "n_kv_head": 2, "tie_embeddings": False}])
def test_the_folder_computes_our_function_far_from_init(model, tmp_path):
    """Weights far from their small initial values (every activation's non-linear range, the norms'
    weights and biases not one and zero): what a mapping error or a GELU variant would show in."""
    transformers = pytest.importorskip("transformers", reason=HF_REASON)
    cfg = ModelConfig(**{"n_layer": 2, "n_head": 4, "d_model": 32, "context": 16, **model})
    gen = torch.Generator().manual_seed(9)
    params = {n: torch.randn(t.shape, generator=gen) * (0.3 if t.dim() > 1 else 1.0) + (1.0 if t.dim() == 1 else 0.0)
              for n, t in get_params(build_model(cfg)).items()}
    ours = build_model(cfg).eval()
    set_params(ours, params)
    export.write_hf_folder(tmp_path / "hf", cfg, params, bytes_tokenizer(), {"run": "t"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.context), generator=gen)
    with torch.no_grad():
        want = ours(idx)[0]
        torch.testing.assert_close(hf(input_ids=idx).logits, want, rtol=1e-5, atol=1e-5)


def test_every_file_of_an_exported_folder_has_the_same_mode(tmp_path):
    """model.safetensors was written 0600 (safetensors' save_file) beside 0644 config and tokenizer files."""
    import os
    import stat

    from shared.files import umask

    cfg = ModelConfig(n_layer=1, n_head=2, d_model=16, context=16)
    export.write_hf_folder(tmp_path / "hf", cfg, get_params(build_model(cfg)), bytes_tokenizer(), {"run": "t"})
    modes = {p.name: stat.S_IMODE(os.stat(p).st_mode) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask()}, modes


def test_a_bpe_tokenizer_travels_into_the_folder(tmp_path):
    transformers = pytest.importorskip("transformers", reason=HF_REASON)
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)]
    bpe = train_bpe(iter(texts), vocab_size=320)
    cfg = ModelConfig(arch="llama", vocab_size=320, n_layer=1, n_head=2, d_model=32, context=32)
    ours = build_model(cfg, seed=4).eval()
    export.write_hf_folder(tmp_path / "hf", cfg, get_params(ours), bpe, {"run": "t", "version": "7"})
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "def f12(x):\n    return x * 12"
    assert tok(text)["input_ids"] == bpe.encode(text) and len(bpe.encode(text)) < len(text.encode())
    assert tok.decode(bpe.encode(text)) == text
    assert tok.eos_token == EOT and tok.eos_token_id == bpe.eot_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.eos_token_id == bpe.eot_id
    out = hf.generate(torch.tensor([bpe.encode("def ")]), max_new_tokens=8, do_sample=True, top_k=20,
                      pad_token_id=bpe.eot_id)
    assert out.shape[1] > len(bpe.encode("def ")) and isinstance(tok.decode(out[0]), str)


def test_export_hf_refusals(api, tmp_path, capsys):
    argv = ["--format", "hf", "--run", "t", "--coordinator", URL]
    assert cli.main(["export", str(tmp_path / "m.safetensors"), *argv]) == 2
    assert "--format hf writes a folder" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert cli.main(["export", str(tmp_path / "afile"), *argv]) == 2
    assert "writes a folder" in capsys.readouterr().err
    cfg = ModelConfig(vocab_size=256, n_layer=1, n_head=2, d_model=16, context=8)
    big = train_bpe(iter(["hello world, hello tokens"] * 20), vocab_size=300)
    with pytest.raises(ValueError, match="tokenizer has .* tokens but its model only 256"):
        export.write_hf_folder(tmp_path / "x", cfg, get_params(build_model(cfg)), big, {})


def test_the_run_tokenizer_is_fetched_checked_or_bytes_from_an_older_coordinator(monkeypatch):
    bpe = train_bpe(iter(["some words to merge, some words"] * 10), vocab_size=280)
    answers = {}
    monkeypatch.setattr(httpx, "get", lambda url, timeout: answers[url])
    url = f"{URL}/api/v1/runs/r/tokenizer"
    answers[url] = httpx.Response(200, text=bpe.to_json(), headers={"etag": f'"{bpe.sha256}"'})
    assert export.fetch_tokenizer(URL, "r").sha256 == bpe.sha256
    answers[url] = httpx.Response(200, text=bpe.to_json(), headers={"etag": '"' + "0" * 64 + '"'})
    with pytest.raises(ValueError, match="does not match its ETag"):
        export.fetch_tokenizer(URL, "r")
    answers[url] = httpx.Response(404, json={"detail": "Not Found"})  # no such route: a bytes-only coordinator
    assert export.fetch_tokenizer(URL, "r").kind == "bytes"
    answers[url] = httpx.Response(404, json={"detail": "no run named 'r'"})
    with pytest.raises(ValueError, match="404.*no run named"):
        export.fetch_tokenizer(URL, "r")


def test_a_bpe_run_exports_and_samples_through_its_tokenizer(tmp_path, open_api, run_config, make_delta, monkeypatch,
                                                             capsys):
    """A run on data prepared with a BPE tokenizer (`idletrain data prepare`): the coordinator serves
    the tokenizer, the folder carries it, and `sample` encodes and decodes with it."""
    transformers = pytest.importorskip("transformers", reason=HF_REASON)
    root = tmp_path / "corpora"
    root.mkdir()
    (root / "src.txt").write_text("".join(f"def add_{i % 50}(x, y):\n    return x + y * {i % 7}\n\n"
                                          for i in range(2000)))
    prepare(root / "src.txt", root / "bpe", tokenizer="bpe", vocab_size=300, shard_tokens=4096, eval_tokens=2048)
    bpe = Tokenizer.from_file(root / "bpe" / "tokenizer.json")
    config = run_config(data=str(root / "bpe"), shard_tokens=1024, eval_tokens=1024,
                        model={"arch": "llama", "vocab_size": bpe.vocab_size, "context": 16})
    del config["corpus"], config["corpus_max_bytes"]
    with serving(open_api, tmp_path, config, make_delta, monkeypatch, corpus_dirs=[root]):
        argv = ["--run", "t", "--coordinator", URL]
        assert cli.main(["export", str(tmp_path / "hf"), "--format", "hf", *argv]) == 0
        assert "bpe tokenizer (300 tokens)" in capsys.readouterr().out
        sample = ["sample", "--prompt", "def add_", "--tokens", "12", "--seed", "3", *argv]
        assert cli.main(sample) == 0
        first = capsys.readouterr()
        assert first.out.startswith("def add_") and "bpe tokenizer" in first.err
        assert cli.main(sample) == 0
        assert capsys.readouterr().out == first.out  # same seed, same text
        # an empty prompt starts from the document separator, which is not printed
        assert cli.main(["sample", "--prompt", "", "--tokens", "5", *argv]) == 0
        assert capsys.readouterr().out.endswith("\n")
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == bpe.to_json()
    assert tok("def add_7(x, y):")["input_ids"] == bpe.encode("def add_7(x, y):")
    assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).config.vocab_size == 300
