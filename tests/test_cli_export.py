"""`idletrain export` (the trained model as .safetensors) and `idletrain sample` (text from it)."""

from __future__ import annotations

import json

import httpx
import pytest
import safetensors.torch
import torch

from coordinator.settings import CoordinatorSettings
from idletrain import cli
from shared.model import ModelConfig, build_model, generate, param_schema, set_params
from shared.snapshot import decode_snapshot

URL = "http://coordinator.test"


@pytest.fixture
def api(tmp_path, open_api, run_config, make_delta, monkeypatch):
    with open_api(CoordinatorSettings(data_dir=tmp_path / "coord")) as api:
        api.create_run(run_config())
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
