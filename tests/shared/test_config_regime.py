"""A run's regime: a diloco run that states its length (schedule_tokens) and plans at least
LONG_RUN_STEPS local steps a worker takes the long-run configuration for every field the regime decides
that it leaves out; anything else keeps the short-run defaults. The config that results reads back the same."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from shared import protocol
from shared.config import (LONG_RUN_LR_FACTOR, LONG_RUN_STEPS, CompressionConfig, InnerConfig, RunConfig,
                           choose_regime)

BATCH, CONTEXT, GROUP = 16, 128, 4  # InnerConfig's, ModelConfig's and OuterConfig's defaults
LONG = LONG_RUN_STEPS * GROUP * BATCH * CONTEXT  # schedule_tokens of exactly LONG_RUN_STEPS steps a worker


def knobs(cfg: RunConfig) -> tuple:
    return (cfg.inner.steps, cfg.inner.lr, cfg.inner.second_moment_workers, cfg.compression.values,
            cfg.update_values, cfg.update_feedback, cfg.outer.lr, cfg.outer.momentum)


SHORT = knobs(RunConfig(name="t"))


def test_a_long_run_that_leaves_the_regime_to_the_defaults_gets_the_long_run_configuration():
    cfg = RunConfig(name="t", schedule_tokens=LONG)
    lr = InnerConfig().lr * LONG_RUN_LR_FACTOR
    assert knobs(cfg) == (19, pytest.approx(lr), GROUP, "int1", "int1", True, 1.2, 0.0)
    assert cfg.compression.index == "dense" and cfg.compression.error_feedback
    assert protocol.lease_api_version(cfg) == 4  # its leases need workers that know int1 and the copies
    assert SHORT == (100, InnerConfig().lr, 1, "int4", "int4", False, 0.8, 0.2)


def test_a_shorter_run_or_one_that_does_not_say_its_length_keeps_the_short_run_defaults():
    assert knobs(RunConfig(name="t", schedule_tokens=LONG - 1)) == SHORT
    assert knobs(RunConfig(name="t")) == SHORT  # schedule_tokens' default is a placeholder, not a plan
    # the plan counts the group, the batch and the context: 8 workers halve each one's steps
    assert knobs(RunConfig(name="t", schedule_tokens=LONG, outer={"group": 8})) == SHORT
    assert knobs(RunConfig(name="t", schedule_tokens=LONG, inner=InnerConfig(batch_size=8)))[0] == 19
    assert knobs(RunConfig(name="t", schedule_tokens=LONG, model={"context": 256})) == SHORT
    assert knobs(RunConfig(name="t", schedule_tokens=LONG, algorithm="sparta")) == SHORT


def test_an_inner_lr_given_is_kept_and_the_rest_left_to_the_regime():
    """The lr depends on the model: giving it does not opt out of the long-run defaults."""
    cfg = RunConfig(name="t", schedule_tokens=LONG, inner=InnerConfig(lr=7e-4))
    assert knobs(cfg)[:3] == (19, 7e-4, GROUP) and knobs(cfg)[3:] == ("int1", "int1", True, 1.2, 0.0)
    assert RunConfig.model_validate_json(cfg.model_dump_json()) == cfg


@pytest.mark.parametrize("given", [{"inner": {"steps": 50}}, {"inner": InnerConfig(steps=20)},
                                   {"compression": {"values": "int8"}}, {"update_values": "int8"},
                                   {"outer": {"momentum": 0.9}}, {"inner": {"second_moment_workers": 2}}])
def test_setting_any_field_the_regime_decides_keeps_the_short_run_defaults_for_the_rest(given):
    cfg = RunConfig.model_validate({"name": "t", "schedule_tokens": LONG, **given})
    assert cfg.inner.steps != 19 and cfg.compression.values != "int1" and not cfg.update_feedback


def test_regime_long_fills_only_what_is_not_given():
    cfg = RunConfig.model_validate({"name": "t", "regime": "long", "inner": {"steps": 30}})
    assert knobs(cfg)[0] == 30 and knobs(cfg)[3:] == ("int1", "int1", True, 1.2, 0.0)
    # int1 is for dense values under error feedback, int1 updates for the worker's copy: given otherwise, kept
    topk = RunConfig.model_validate({"name": "t", "regime": "long", "compression": {"index": "topk"}})
    assert topk.compression == CompressionConfig(index="topk") and topk.update_values == "int1"
    for off in (False, "false"):  # as TOML and JSON give it, and as the CLI's --update-feedback passes it
        plain = RunConfig.model_validate({"name": "t", "regime": "long", "update_feedback": off})
        assert (plain.update_values, plain.update_feedback, plain.compression.values) == ("int4", False, "int1")
    on = RunConfig.model_validate({"name": "t", "regime": "long", "update_feedback": "true"})
    assert (on.update_values, on.update_feedback) == ("int1", True)


def test_regime_short_keeps_the_short_run_defaults_in_a_long_run():
    assert knobs(RunConfig.model_validate({"name": "t", "regime": "short", "schedule_tokens": LONG})) == SHORT


@pytest.mark.parametrize("data", [{"schedule_tokens": LONG}, {"schedule_tokens": LONG, "regime": "short"},
                                  {"regime": "long", "inner": {"steps": 30}}, {}, {"schedule_tokens": LONG - 1}])
def test_the_resolved_config_reads_back_the_same(data):
    """The coordinator stores the config's JSON and every reader (its services, the worker) validates it
    again: the regime must not be chosen a second time. `regime` itself is not kept."""
    cfg = RunConfig.model_validate({"name": "t", **data})
    text = cfg.model_dump_json()
    assert "regime" not in json.loads(text)
    assert RunConfig.model_validate_json(text) == cfg
    assert RunConfig.model_validate(cfg.model_dump()) == cfg


@pytest.mark.parametrize("data, says", [
    ({"regime": "longer"}, "regime must be one of auto, short, long"),
    ({"regime": "long", "algorithm": "sparta"}, "regime 'long' sets diloco's rounds"),
    ({"schedule_tokens": "many"}, "schedule_tokens"),  # a bad field is its own validation's to report
    ({"schedule_tokens": LONG, "model": {"context": 0}}, "context must be a positive integer"),
    ({"schedule_tokens": LONG, "outer": {"group": 0}}, "group"),
    ({"regime": "long", "inner": 5}, "inner"),  # not filled over: refused as it stands
    ({"regime": "long", "compression": "int1"}, "compression"),
])
def test_bad_input_says_what_is_wrong(data, says):
    with pytest.raises(ValidationError, match=says):
        RunConfig.model_validate({"name": "t", **data})


def test_choose_regime_is_the_rule_the_benchmarks_resolve_their_default_with():
    """bench/convergence_long.py's default row is the long-run configuration where this rule says long."""
    import dataclasses

    from bench.convergence_long import LONG_PROFILES, default_method, long_run_method, short_run_method

    p = LONG_PROFILES["long"]
    assert default_method(p, 8) == dataclasses.replace(long_run_method(short_run_method(p, 8), 8),
                                                       name=default_method(p, 8).name)
    assert default_method(p, 8).inner_lr_factor == LONG_RUN_LR_FACTOR and default_method(p, 8).H == 19
    tiny = LONG_PROFILES["long-tiny"]
    assert default_method(tiny, 2).H == tiny.H and default_method(tiny, 2).name.endswith("(default)")
    data = {"schedule_tokens": LONG, "inner": {"batch_size": BATCH}, "outer": {"group": GROUP}}
    assert choose_regime(data) == "long" and choose_regime({**data, "schedule_tokens": LONG - 1}) == "short"


def test_the_short_profiles_run_the_short_run_defaults():
    """The quick, full and gpu convergence profiles (160 / 250 / 400 local steps a worker) are short runs: their
    default rows are the short-run defaults; the long profile's (6,400 at M = 8) the long-run configuration."""
    from bench.convergence import PROFILES, methods_for

    for name, p in PROFILES.items():
        default = next(m for m in methods_for(p, workers=8) if m.name.endswith("(default)"))
        assert (default.H, default.compression.values, default.second_moment_workers) == (p.H, "int4", 1), name
        assert p.steps_per_worker < LONG_RUN_STEPS
