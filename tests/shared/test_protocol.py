"""shared/protocol.py: what a coordinator sends a worker is checked against its exact form by the
models themselves, so no caller can forget to (the worker does not trust the coordinator)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared import protocol
from shared.model import ModelConfig


def lease_body(**over) -> dict:
    body = {"lease_id": 7, "run": "t", "shard_id": 2, "shard_sha256": "ab" * 32, "base_version": 3, "seed": 11,
            "lr": 1e-3, "inner": {"steps": 3}, "compression": {}, "model": ModelConfig().to_dict(),
            "deadline": "2030-01-01T00:00:00Z", "init_seed": 0}
    return body | over


def test_a_coordinator_lease_validates():
    lease = protocol.Lease.model_validate(lease_body())
    assert lease.shard_sha256 == "ab" * 32 and lease.model.to_dict() == ModelConfig().to_dict()
    assert protocol.Lease.model_validate(lease.model_dump(mode="json")) == lease


@pytest.mark.parametrize("field,value", [
    ("shard_sha256", "/etc/passwd"), ("shard_sha256", "../../x"), ("shard_sha256", "a" * 63),
    ("shard_sha256", "a" * 65), ("shard_sha256", "AB" * 32), ("shard_sha256", "ab" * 32 + "\n"),
    ("shard_sha256", "g" * 64), ("shard_sha256", ""),
    ("run", "../other"), ("run", "a/b"), ("run", ""), ("run", "x" * 65), ("run", "t\n"),
    ("lease_id", 0), ("lease_id", -1), ("lease_id", 2**63), ("shard_id", -1), ("base_version", -1),
    ("seed", -1), ("seed", 2**64), ("init_seed", -5), ("lr", -0.1), ("lr", 1e9), ("lr", float("nan")),
    ("model", {"n_layer": 10**9}), ("model", {"n_layer": 2, "surprise": 1}), ("model", {"n_layer": True}),
    ("model", {"d_model": "128"}), ("model", {"n_layer": 48, "d_model": 65536, "n_head": 64}),
])
def test_a_lease_out_of_form_is_refused(field, value):
    with pytest.raises(ValidationError) as info:
        protocol.Lease.model_validate(lease_body(**{field: value}))
    assert info.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("token", ["", "a b", "t\r\nX-Evil: 1", "x" * 257, "é", "a/b"])
def test_a_registration_token_out_of_form_is_refused(token):
    with pytest.raises(ValidationError, match="token"):
        protocol.RegisterResponse.model_validate({"worker_id": 1, "token": token})


def test_a_token_urlsafe_is_accepted():
    import secrets

    token = secrets.token_urlsafe(32)
    assert protocol.RegisterResponse.model_validate({"worker_id": 1, "token": token}).token == token


@pytest.mark.parametrize("body", [{"lease_id": 0, "delta_id": 1, "will_merge_into": 1},
                                  {"lease_id": 1, "delta_id": -1, "will_merge_into": 1},
                                  {"lease_id": 1, "delta_id": 1, "will_merge_into": -1}])
def test_an_acknowledgement_out_of_range_is_refused(body):
    with pytest.raises(ValidationError):
        protocol.DeltaAccepted.model_validate(body)
