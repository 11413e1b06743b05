"""A run config's JSON leaves out the fields a worker of the previous API version does not know
while they hold their defaults (it refuses unknown fields), and keeps them, round-tripping, when set."""

from __future__ import annotations

import json

from shared.config import RunConfig

NEW_FIELDS = {"outer": "warmup", "compression": "feedback_decay"}


def test_the_default_run_config_has_none_of_the_new_fields():
    data = json.loads(RunConfig(name="t").model_dump_json())
    for section, field in NEW_FIELDS.items():
        assert field not in data[section] and field not in RunConfig(name="t").model_dump()[section]
    # ... and a reader that knows them reads their defaults back
    again = RunConfig.model_validate(data)
    assert (again.outer.warmup, again.compression.feedback_decay) == (0, 1.0)


def test_new_fields_travel_once_set_and_round_trip():
    cfg = RunConfig(name="t", outer={"warmup": 4}, compression={"index": "topk", "feedback_decay": 0.95})
    data = json.loads(cfg.model_dump_json())
    assert data["outer"]["warmup"] == 4 and data["compression"]["feedback_decay"] == 0.95
    assert RunConfig.model_validate(data) == cfg

