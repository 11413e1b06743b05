"""The `idletrain` command line: help, config building, and its error messages (exit 2)."""

from __future__ import annotations

import httpx
import pytest

from shared.config import OuterConfig

from idletrain import cli
from idletrain.cli import operator
from idletrain.harness import free_port

SUBCOMMANDS = [[], ["coordinator"], ["coordinator", "serve"], ["coordinator", "migrate"], ["run"], ["run", "create"],
               ["worker"], ["bench", "convergence"], ["bench", "averaging"], ["bench", "merge"], ["bench", "load"],
               ["worker", "run"], ["status"], ["demo"], ["run", "list"], ["run", "show"], ["run", "pause"],
               ["run", "resume"], ["worker", "list"], ["worker", "revoke"], ["worker", "readmit"], ["export"],
               ["sample"], ["bench"], ["bench", "utilisation"]]


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=lambda a: " ".join(a) or "idletrain")
def test_help_exits_zero(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: idletrain")


def test_help_lists_the_run_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "create", "--help"])
    out = capsys.readouterr().out
    for flag, *_ in operator.RUN_FLAGS:
        assert flag in out


def test_bench_forwards_to_python_m_bench(monkeypatch):
    """In a source checkout `idletrain bench ARGS` is `python -m bench ARGS`, --log-level passed on."""
    import bench.__main__

    seen = {}

    def fake_main(argv, prog):
        seen.update(argv=argv, prog=prog)
        return 7

    monkeypatch.setattr(bench.__main__, "main", fake_main)
    assert cli.main(["--log-level", "WARNING", "bench", "merge", "--deltas", "3", "--help"]) == 7
    assert seen == {"argv": ["--log-level", "WARNING", "merge", "--deltas", "3", "--help"], "prog": "idletrain bench"}


def test_bench_without_a_source_checkout_says_where_the_benchmarks_live(monkeypatch, capsys):
    """The installed package has no bench/: one line saying how to run them, exit 2, no traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "bench", None)  # `import bench` fails as it does outside a checkout
    monkeypatch.setitem(sys.modules, "bench.__main__", None)
    assert cli.main(["bench", "convergence", "--profile", "quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("idletrain: ") and "Traceback" not in err
    assert "source repository" in err and "python -m bench convergence" in err and "pip install -e '.[bench]'" in err


def test_missing_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "required" in capsys.readouterr().err


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the CLI contacted the coordinator")

    monkeypatch.setattr(httpx, "post", refuse)
    monkeypatch.setattr(httpx, "get", refuse)


@pytest.mark.parametrize("flags, words", [
    (["--steps", "0"], ["bad run config", "inner.steps"]),
    (["--fraction", "2"], ["bad run config", "compression.fraction"]),
    (["--values", "int3"], ["bad run config", "compression.values"]),
    (["--compression", "dense", "--fraction", "0.5"], ["bad run config", "fraction"]),  # dense sends all
    (["--shard-tokens", "64"], ["bad run config", "shard_tokens"]),
])
def test_run_create_with_an_invalid_value_fails_before_any_request(no_network, capsys, flags, words):
    assert cli.main(["run", "create", "myrun", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("idletrain: ")
    for word in words:
        assert word in err


def test_run_create_with_a_bad_name_fails_before_any_request(no_network, capsys):
    assert cli.main(["run", "create", "no spaces please"]) == 2
    assert "name" in capsys.readouterr().err


def test_run_create_with_a_malformed_number_is_a_usage_error(no_network, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "create", "myrun", "--steps", "many"])
    assert info.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_run_create_with_a_missing_config_file(no_network, tmp_path, capsys):
    assert cli.main(["run", "create", "myrun", "--config", str(tmp_path / "absent.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_run_create_with_invalid_toml(no_network, tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("[inner\nsteps = 3\n")
    assert cli.main(["run", "create", "myrun", "--config", str(path)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_run_create_against_an_unreachable_coordinator(capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert cli.main(["run", "create", "myrun", "--coordinator", url, "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and url in err


def test_status_against_an_unreachable_coordinator(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["status", "--coordinator", url, "--run", "t"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_worker_run_with_a_bad_url_fails_before_any_request(capsys, tmp_path):
    assert cli.main(["worker", "run", "--coordinator", "127.0.0.1:8000", "--run", "t",
                     "--state-dir", str(tmp_path)]) == 2
    assert "http://" in capsys.readouterr().err


def test_run_create_posts_the_config_and_reports_refusals(monkeypatch, capsys):
    sent = {}

    def fake_post(url, json, headers, timeout):
        sent.update(url=url, json=json, headers=headers)
        return httpx.Response(409, json={"detail": "a run named 'myrun' exists already; pick another name"})

    monkeypatch.setattr(httpx, "post", fake_post)
    code = cli.main(["run", "create", "myrun", "--coordinator", "http://127.0.0.1:9", "--admin-token", "s" * 16,
                     "--steps", "7", "--group", "3"])
    assert code == 2
    assert "409" in capsys.readouterr().err
    assert sent["url"] == "http://127.0.0.1:9/api/v1/runs"
    assert sent["headers"] == {"Authorization": "Bearer " + "s" * 16}
    assert sent["json"]["name"] == "myrun"
    assert sent["json"]["inner"]["steps"] == 7 and sent["json"]["outer"]["group"] == 3


def test_run_create_says_what_it_waits_for_and_that_it_still_does(monkeypatch, capsys):
    """Creating a `small` run took 2 min 17 s in silence (its reference round): it says what it does,
    that it is still at it while the coordinator works, and how long it took."""
    import threading

    from idletrain.cli import common

    ticked = threading.Event()
    real_print = print

    def fake_post(url, json, headers, timeout):
        assert ticked.wait(30), "no 'still at it' line while the coordinator worked"
        return httpx.Response(201, json={"name": "myrun", "n_shards": 3})

    def spy_print(*a, **kw):
        real_print(*a, **kw)
        if a and "still at it" in str(a[0]):
            ticked.set()

    monkeypatch.setattr(httpx, "post", fake_post)
    monkeypatch.setattr(common, "TICK_S", 0.01)
    monkeypatch.setattr("builtins.print", spy_print)
    assert cli.main(["run", "create", "myrun", "--coordinator", "http://127.0.0.1:9", "--admin-token", "s" * 16]) == 0
    err = capsys.readouterr().err
    assert "creating run 'myrun': the coordinator shards its data and trains one reference round of its" in err
    assert "-parameter model" in err and "... still at it (" in err and err.count("  (") >= 1


def test_run_create_says_how_much_of_the_data_is_in_no_shard(monkeypatch, capsys):
    """4.4% of a prepared corpus went unused (the tail past 12 shards) and nothing said so."""
    created = {"name": "m", "n_shards": 12, "n_params": 1, "train_tokens": 12 * 262_144, "eval_tokens": 10,
               "unused_tokens": 145_798}
    monkeypatch.setattr(httpx, "post", lambda url, json, headers, timeout: httpx.Response(201, json=created))
    assert cli.main(["run", "create", "m", "--coordinator", "http://127.0.0.1:9", "--admin-token", "s" * 16]) == 0
    err = capsys.readouterr().err
    assert "145,798 of the data's 3,291,526 training tokens (4.4%) are in no shard: the tail past 12 shards of" in err
    assert "--shard-tokens 253,194 would cut 13 shards and leave 4 out" in err


@pytest.mark.parametrize("args, says, steps", [
    (["--schedule-tokens", str(600 * 4 * 16 * 128)], "long-run defaults (600 local steps a worker planned", 19),
    (["--schedule-tokens", str(599 * 4 * 16 * 128)], "short-run defaults: 599 local steps a worker planned", 100),
    (["--schedule-tokens", str(10**9), "--regime", "short"], None, 100),
    (["--regime", "long", "--steps", "30"], "long-run defaults (regime long): rounds of 30", 30),
    (["--schedule-tokens", str(10**9), "--lr", "7e-4"], "at lr 0.0007 as given (the long-run configuration takes "
                                                        "0.7x", 19),
])
def test_run_create_says_which_defaults_the_runs_length_gave_it(monkeypatch, capsys, args, says, steps):
    sent = {}

    def fake_post(url, json, headers, timeout):
        sent.update(json=json)
        return httpx.Response(201, json={"name": "r", "n_shards": 1, "n_params": 1})

    monkeypatch.setattr(httpx, "post", fake_post)
    assert cli.main(["run", "create", "r", "--coordinator", "http://127.0.0.1:9", "--admin-token", "s" * 16,
                     *args]) == 0
    err = capsys.readouterr().err
    assert (says in err) if says else ("defaults" not in err)
    assert sent["json"]["inner"]["steps"] == steps and "regime" not in sent["json"]


def test_run_create_refuses_an_unknown_regime(capsys):
    assert cli.main(["run", "create", "r", "--coordinator", "http://127.0.0.1:9", "--regime", "medium"]) == 2
    assert "regime must be one of auto, short, long" in capsys.readouterr().err


def test_build_run_config_merges_toml_and_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'name = "ignored"\n'
        'shard_tokens = 4096\n'
        'eval_every = 3\n'
        '[model]\nn_layer = 2\nd_model = 64\nn_head = 4\ncontext = 64\n'
        '[inner]\nsteps = 20\nbatch_size = 8\nlr = 1e-3\n'
        '[compression]\nindex = "random"\nfraction = 0.05\n'
        '[outer]\ngroup = 6\n')
    flags = {key: None for _, key, _, _ in operator.RUN_FLAGS}
    flags.update({"inner.steps": 50, "compression.values": "int4", "seed": 9})
    cfg = operator.build_run_config("mine", str(path), flags)
    assert cfg.name == "mine"  # the positional name wins over the file
    assert cfg.shard_tokens == 4096 and cfg.eval_every == 3 and cfg.seed == 9
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head, cfg.model.context) == (2, 64, 4, 64)
    assert cfg.inner.steps == 50  # the flag overrides the file
    assert cfg.inner.batch_size == 8 and cfg.inner.lr == 1e-3  # the rest of [inner] stays
    assert (cfg.compression.index, cfg.compression.fraction, cfg.compression.values) == ("random", 0.05, "int4")
    assert cfg.outer.group == 6 and cfg.outer.lr == OuterConfig().lr  # unspecified fields keep their defaults


def test_build_run_config_without_a_file_uses_defaults_and_flags():
    cfg = operator.build_run_config("plain", None, {"inner.lr": 5e-3, "outer.momentum": None})
    assert cfg.inner.lr == 5e-3 and cfg.inner.steps == 100 and cfg.outer.momentum == OuterConfig().momentum


def test_build_run_config_model_and_algorithm_flags():
    cfg = operator.build_run_config("m", None, {"model.n_layer": 2, "model.d_model": 64, "algorithm": "sparta",
                                           "sparta.p": 0.01})
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head) == (2, 64, 4)
    assert cfg.algorithm == "sparta" and cfg.sparta.p == 0.01


def test_build_run_config_rejects_unknown_toml_keys(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[inner]\nstepz = 3\n")
    with pytest.raises(ValueError, match="stepz"):
        operator.build_run_config("mine", str(path), {})


def test_format_status_one_line():
    st = {"name": "t", "state": "active", "version": 4, "merged_deltas": 3, "pending_deltas": 1,
          "rejected_deltas": 0, "workers_active": 2, "workers_total": 3, "tokens_trained": 12345,
          "eval_history": [{"loss": 5.5, "version": 0}, {"loss": 3.25, "version": 3}], "bytes_up": 2_000_000,
          "bytes_down": 500_000, "traffic_ratio_vs_dense": 40.0, "next_eval_version": 6}
    line = operator.format_status(st)
    assert "version 4" in line and "12,345" in line and "40x" in line
    # which versions the losses are of, and when the next comes (issue 36: "9.003 -> 9.003" said neither)
    assert "eval loss 5.500 at v0 -> 3.250 at v3 (next at v6)" in line
    assert "\n" not in line


@pytest.mark.parametrize("extra, words", [
    (["--processes", "2"], "need PostgreSQL"),
    (["--processes", "0"], "greater than or equal to 1"),
])
def test_serve_refuses_what_it_cannot_do(tmp_path, capsys, monkeypatch, extra, words):
    monkeypatch.delenv("IDLETRAIN_DATABASE_URL", raising=False)
    assert cli.main(["coordinator", "serve", "--data-dir", str(tmp_path / "d"), *extra]) == 2
    assert words in capsys.readouterr().err


def test_the_demo_summary_says_how_many_deltas_were_merged_and_rejected():
    from idletrain.demo import summarise

    status = {"eval_history": [{"loss": 5.4}, {"loss": 2.2}], "tokens_trained": 1000, "merged_deltas": 27,
              "rejected_deltas": 2, "bytes_up": 10, "bytes_down": 20, "traffic_ratio_vs_dense": 300.0}
    summary = summarise(status)
    assert (summary["merged_deltas"], summary["rejected_deltas"]) == (27, 2)
    assert (summary["eval_loss_first"], summary["eval_loss_last"]) == (5.4, 2.2)


def test_the_demo_summary_says_why_deltas_were_rejected(tmp_path):
    """The reasons come from the coordinator's own /metrics, rendered by its real Metrics."""
    import io
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from coordinator.app import create_app
    from coordinator.settings import CoordinatorSettings
    from idletrain.demo import _print_summary, rejection_reasons, summarise
    from shared.algorithms.robust import Rejection

    app = create_app(CoordinatorSettings(data_dir=tmp_path / "c"))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        for run, n in (("demo", 2), ("other", 5)):  # what the merger reports for each delta it rejected
            for _ in range(n):
                client.app.state.metrics.observe_merge(SimpleNamespace(config=SimpleNamespace(name=run)),
                                                       SimpleNamespace(merged=False, rejection=Rejection.STALE), 0.01)
        reasons = rejection_reasons(client.get("/metrics").text)
    assert reasons == {"stale": 2}
    assert rejection_reasons("not the Prometheus text format {") == {}  # the summary goes on without reasons
    status = {"eval_history": [{"loss": 5.4}, {"loss": 2.2}], "tokens_trained": 1000, "merged_deltas": 27,
              "rejected_deltas": 2, "bytes_up": 10, "bytes_down": 20, "traffic_ratio_vs_dense": 300.0,
              "worker_steps": 100, "version": 27, "bytes_down_model": 5, "bytes_down_data": 15,
              "dense_equivalent_bytes": 3000}
    out = io.StringIO()
    _print_summary(summarise(status, reasons), status, out)
    assert "27 (version 27, 2 rejected: stale 2)" in out.getvalue()


def _serve_captured(tmp_path, monkeypatch, *extra) -> dict:
    """What `idletrain coordinator serve` hands uvicorn.run (the app, or its factory, and every
    keyword), without serving: uvicorn.run is replaced for the call."""
    import os

    import uvicorn

    captured: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: captured.update(app=app, **kw))
    saved = dict(os.environ)  # serve --processes N hands its settings on as IDLETRAIN_* variables
    try:
        assert cli.main(["coordinator", "serve", "--data-dir", str(tmp_path / "d"), *extra]) == 0
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return captured


@pytest.mark.parametrize("extra", [[], ["--processes", "2", "--database-url", "postgresql+psycopg://u@h/db"]],
                         ids=["one process", "processes"])
def test_serve_believes_x_forwarded_for_only_from_the_proxies_named(tmp_path, monkeypatch, extra):
    monkeypatch.delenv("IDLETRAIN_FORWARDED_ALLOW_IPS", raising=False)
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    default = _serve_captured(tmp_path, monkeypatch, *extra)
    assert default["proxy_headers"] is False  # uvicorn's own default, True, believes 127.0.0.1
    named = _serve_captured(tmp_path, monkeypatch, *extra, "--forwarded-allow-ips", "127.0.0.1, 10.0.0.0/8")
    assert (named["proxy_headers"], named["forwarded_allow_ips"]) == (True, "127.0.0.1,10.0.0.0/8")


@pytest.mark.parametrize("extra", [[], ["--processes", "2", "--database-url", "postgresql+psycopg://u@h/db"]],
                         ids=["one process", "processes"])
def test_serve_bounds_connections_keep_alive_and_request_heads(tmp_path, monkeypatch, extra):
    """Issue 18: 200 slow connections were never timed out; uvicorn ran with no concurrency limit."""
    import pickle

    from coordinator.connections import ConnectionGuard, GuardedHTTP

    monkeypatch.delenv("IDLETRAIN_MAX_CONNECTIONS_PER_ADDRESS", raising=False)
    monkeypatch.delenv("IDLETRAIN_FORWARDED_ALLOW_IPS", raising=False)
    monkeypatch.delenv("IDLETRAIN_LIMIT_CONCURRENCY", raising=False)
    got = _serve_captured(tmp_path, monkeypatch, *extra)
    assert (got["limit_concurrency"], got["timeout_keep_alive"], got["h11_max_incomplete_event_size"]) == (
        1024, 75, 16 << 10)
    # the protocol: the connection guard with the settings' bounds, a copy of it in each process
    guard = pickle.loads(pickle.dumps(got["http"]))
    assert isinstance(guard, ConnectionGuard) and guard.protocol is GuardedHTTP
    assert (guard.limits.head_timeout_s, guard.limits.body_grace_s, guard.limits.min_body_bytes_per_s,
            guard.limits.max_per_address, guard.limits.exempt) == (20, 10, 2048, 128, ())
    monkeypatch.setenv("IDLETRAIN_LIMIT_CONCURRENCY", "64")
    monkeypatch.setenv("IDLETRAIN_MAX_CONNECTIONS_PER_ADDRESS", "16")
    got = _serve_captured(tmp_path, monkeypatch, *extra, "--forwarded-allow-ips", "127.0.0.1")
    assert got["limit_concurrency"] == 64 and got["http"].limits.max_per_address == 16
    assert not got["http"].limits.capped("127.0.0.1") and got["http"].limits.capped("127.0.0.2")


def test_serve_raises_its_open_files_limit_and_says_when_it_cannot_reach_what_it_needs(monkeypatch, caplog):
    import logging
    import resource

    from idletrain.cli.serve import SPARE_FILES, raise_open_files

    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: calls.append(limits))
    with caplog.at_level(logging.WARNING, logger="idletrain"):
        raise_open_files(1024)
    assert calls == [(4096, 4096)] and not caplog.records  # soft raised to the hard limit, enough
    with caplog.at_level(logging.WARNING, logger="idletrain"):
        raise_open_files(4096)  # 4096 + SPARE_FILES > the hard limit
    assert f"open files are limited to 4096 per process, below the {4096 + SPARE_FILES}" in caplog.text


def test_serve_refuses_a_proxy_list_that_is_not_addresses(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("IDLETRAIN_FORWARDED_ALLOW_IPS", raising=False)
    assert cli.main(["coordinator", "serve", "--data-dir", str(tmp_path / "d"),
                     "--forwarded-allow-ips", "nginx"]) == 2
    assert "not an address or network" in capsys.readouterr().err


def test_a_spoofed_x_forwarded_for_does_not_change_the_registration_key(tmp_path, monkeypatch):
    """Over a real socket, with the server `serve` builds: registrations from loopback that each claim
    another address in X-Forwarded-For are counted as the one client they are (the second over a burst
    of 1 gets 429). With uvicorn's default (believe 127.0.0.1) each claimed address got its own burst."""
    import threading

    import uvicorn

    for name in ("IDLETRAIN_FORWARDED_ALLOW_IPS", "FORWARDED_ALLOW_IPS", "IDLETRAIN_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("IDLETRAIN_REGISTER_RATE", "0.001")
    monkeypatch.setenv("IDLETRAIN_REGISTER_BURST", "1")
    captured = _serve_captured(tmp_path, monkeypatch)
    kwargs = {k: v for k, v in captured.items() if k != "app"}
    kwargs.update(port=free_port(), log_level="warning")
    server = uvicorn.Server(uvicorn.Config(captured["app"], **kwargs))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{kwargs['port']}", timeout=30) as client:
            for _ in range(600):  # the app's start-up (database, migrations) before it listens
                if server.started or not thread.is_alive():
                    break
                thread.join(0.05)
            assert server.started
            # a run that does not exist: the registration limit is taken before the run is looked up
            codes = [client.post("/api/v1/runs/nope/workers", json={"name": "w"},
                                 headers={"X-Forwarded-For": f"203.0.113.{i}"}).status_code for i in (1, 2)]
    finally:
        server.should_exit = True
        thread.join(30)
    assert codes == [404, 429]


# -- worker run: how a round fits (worker/fit.py) ------------------------------------------------------

def _worker_settings(monkeypatch, tmp_path, *flags, env: dict | None = None):
    """The WorkerSettings `idletrain worker run FLAGS` would run with (run_worker replaced)."""
    import worker.loop

    got = {}

    def run_worker(settings):
        got["settings"] = settings
        return 0

    monkeypatch.setattr(worker.loop, "run_worker", run_worker)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    assert cli.main(["worker", "run", "--coordinator", "http://127.0.0.1:9", "--run", "r", "--state-dir",
                     str(tmp_path), "--config", str(_empty_toml(tmp_path)), *flags]) == 0
    return got["settings"]


def _empty_toml(tmp_path):
    path = tmp_path / "worker.toml"
    path.write_text("")
    return path


def test_worker_run_takes_micro_batch_precision_and_checkpointing_flags(monkeypatch, tmp_path):
    for key in ("PRECISION", "MICRO_BATCH", "ACTIVATION_CHECKPOINTING"):
        monkeypatch.delenv(f"IDLETRAIN_WORKER_{key}", raising=False)
    default = _worker_settings(monkeypatch, tmp_path)
    assert (default.micro_batch, default.precision, default.activation_checkpointing) == (None, "auto", False)
    given = _worker_settings(monkeypatch, tmp_path, "--micro-batch", "4", "--precision", "bf16",
                             "--activation-checkpointing")
    assert (given.micro_batch, given.precision, given.activation_checkpointing) == (4, "bf16", True)
    env = _worker_settings(monkeypatch, tmp_path, env={"IDLETRAIN_WORKER_PRECISION": "fp32",
                                                       "IDLETRAIN_WORKER_ACTIVATION_CHECKPOINTING": "true"})
    assert (env.precision, env.activation_checkpointing) == ("fp32", True)


def test_worker_run_refuses_a_bad_micro_batch_or_precision(tmp_path, capsys):
    argv = ["worker", "run", "--coordinator", "http://127.0.0.1:9", "--run", "r", "--state-dir", str(tmp_path),
            "--config", str(_empty_toml(tmp_path))]
    assert cli.main([*argv, "--micro-batch", "0"]) == 2
    assert "micro_batch: Input should be greater than or equal to 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--precision", "fp8"])
    assert info.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


# -- a missing optional extra: one line, non-zero exit, no traceback ---------------------------------

@pytest.fixture
def no_psycopg(monkeypatch):
    """As if the PostgreSQL driver were not installed: `import psycopg` fails."""
    import sys

    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.delenv("IDLETRAIN_DATABASE_URL", raising=False)


@pytest.mark.parametrize("url", ["postgresql+psycopg://u@127.0.0.1:1/db", "postgresql://u:secret@127.0.0.1:1/db",
                                 "postgres://u@127.0.0.1:1/db"])
@pytest.mark.parametrize("extra", [[], ["--processes", "2"]], ids=["one process", "processes"])
def test_serve_without_the_postgres_driver_says_what_to_install(tmp_path, capsys, monkeypatch, no_psycopg,
                                                                url, extra):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: pytest.fail("uvicorn started"))
    assert cli.main(["coordinator", "serve", "--data-dir", str(tmp_path / "d"), "--database-url", url, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "'psycopg'" in err and "pip install 'idletrain[postgres]'" in err
    assert "secret" not in err  # the password is not printed
    assert not (tmp_path / "d" / "admin_token").exists()  # refused before anything was written


def test_migrate_without_the_postgres_driver_says_what_to_install(tmp_path, capsys, no_psycopg):
    assert cli.main(["coordinator", "migrate", "--data-dir", str(tmp_path / "d"),
                     "--database-url", "postgresql+psycopg://u@127.0.0.1:1/db"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'idletrain[postgres]'" in err


def test_serve_with_a_database_sqlalchemy_does_not_know(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("IDLETRAIN_DATABASE_URL", raising=False)
    assert cli.main(["coordinator", "serve", "--data-dir", str(tmp_path / "d"), "--database-url", "oracle9://x"]) == 2
    assert "knows no database 'oracle9'" in capsys.readouterr().err
