"""shared/algorithms/registry.py: one description per algorithm, complete, and the wire's names typed."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from shared import protocol
from shared.algorithms.registry import ALGORITHMS, NAMES, End, Start, check_complete
from shared.config import RunConfig
from shared.model import ModelConfig


def lease_body(**over) -> dict:
    body = {"lease_id": 7, "run": "t", "shard_id": 2, "shard_sha256": "ab" * 32, "base_version": 3, "seed": 11,
            "lr": 1e-3, "inner": {"steps": 3}, "compression": {}, "model": ModelConfig(n_layer=2).to_dict(),
            "deadline": "2030-01-01T00:00:00Z"}
    return body | over


def test_every_name_has_one_entry_under_its_own_name():
    assert NAMES == ("diloco", "sparta", "sparta+diloco")
    assert set(ALGORITHMS) == set(NAMES)
    assert all(algo.name == name for name, algo in ALGORITHMS.items())
    with pytest.raises(TypeError):
        ALGORITHMS["new"] = ALGORITHMS["diloco"]  # read-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        ALGORITHMS["diloco"].exchanges = True


def test_what_each_algorithm_does():
    """The table the call sites read (what they compared names for before)."""
    d, s, sd = ALGORITHMS["diloco"], ALGORITHMS["sparta"], ALGORITHMS["sparta+diloco"]
    assert (d.starts_from, d.ends_with, d.exchanges, d.leases_ahead) == (Start.SNAPSHOT, End.PSEUDO_GRADIENT,
                                                                         False, True)
    assert (s.starts_from, s.ends_with, s.exchanges, s.leases_ahead) == (Start.REPLICA, End.EMPTY, True, False)
    assert (sd.starts_from, sd.ends_with, sd.exchanges, sd.leases_ahead) == (Start.SNAPSHOT, End.PSEUDO_GRADIENT,
                                                                             True, False)


def test_an_incomplete_registry_is_refused():
    diloco = ALGORITHMS["diloco"]
    check_complete(("diloco",), {"diloco": diloco})
    with pytest.raises(RuntimeError, match="no entry for \\['sparta'\\]"):
        check_complete(("diloco", "sparta"), {"diloco": diloco})
    with pytest.raises(RuntimeError, match="no name for \\['extra'\\]"):
        check_complete(("diloco",), {"diloco": diloco, "extra": dataclasses.replace(diloco, name="extra")})
    with pytest.raises(RuntimeError, match="another name: \\['sparta'\\]"):
        check_complete(("diloco", "sparta"), {"diloco": diloco, "sparta": diloco})
    with pytest.raises(RuntimeError):
        check_complete(("diloco", "diloco"), {"diloco": diloco})


@pytest.mark.parametrize("name", NAMES)
def test_the_wire_carries_every_name_as_it_is(name):
    cfg = RunConfig(name="r", algorithm=name)
    assert cfg.algorithm == name and isinstance(cfg.algorithm, str)
    assert RunConfig.model_validate_json(cfg.model_dump_json()).algorithm == name
    lease = protocol.Lease.model_validate(lease_body(algorithm=name))
    assert lease.model_dump(mode="json")["algorithm"] == name and ALGORITHMS[lease.algorithm].name == name


def test_an_unknown_name_is_refused_on_both_sides():
    with pytest.raises(ValidationError):
        RunConfig(name="r", algorithm="ddp")
    with pytest.raises(ValidationError, match="does not know the algorithm 'ddp'.*upgrade idletrain") as info:
        protocol.Lease.model_validate(lease_body(algorithm="ddp"))
    assert info.value.errors()[0]["loc"] == ("algorithm",)
    assert protocol.Lease.model_validate(lease_body()).algorithm == "diloco"  # absent: what older coordinators meant


def test_the_lease_model_is_a_model_config_with_the_same_json():
    lease = protocol.Lease.model_validate(lease_body())
    assert lease.model == ModelConfig(n_layer=2)
    assert lease.model_dump(mode="json")["model"] == ModelConfig(n_layer=2).to_dict()
    assert protocol.Lease(**lease_body(model=ModelConfig(n_layer=2))) == lease  # an instance is taken as is
    with pytest.raises(ValidationError):
        protocol.Lease.model_validate(lease_body(model="n_layer=2"))
