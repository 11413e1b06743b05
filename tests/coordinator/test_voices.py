"""Which tokens speak as one: a delta's voice (coordinator/voices.py), and what sharing one does."""

from __future__ import annotations

import pytest

from coordinator import voices

LOCAL = voices.networks("127.0.0.1,::1")


def test_tokens_of_one_address_share_a_voice():
    a = voices.voice_of("203.0.113.7", team_id=None, ungrouped=LOCAL)
    assert a is not None and a == voices.voice_of("203.0.113.7", team_id=None, ungrouped=LOCAL)
    assert a != voices.voice_of("203.0.113.8", team_id=None, ungrouped=LOCAL)
    assert "203.0.113.7" not in a  # a digest: the screen's state never holds an address
    six = voices.voice_of("2001:db8:1:2::/64", team_id=None, ungrouped=LOCAL)  # leases count IPv6 by its /64
    assert six is not None and six != a


def test_a_verified_team_member_local_workers_and_non_addresses_keep_their_own():
    assert voices.voice_of("203.0.113.7", team_id=3, ungrouped=LOCAL) is None  # the operator vouched
    assert voices.voice_of("127.0.0.1", team_id=None, ungrouped=LOCAL) is None  # the coordinator's own machine
    assert voices.voice_of("127.0.0.9", team_id=None, ungrouped=LOCAL) is not None  # another loopback address
    assert voices.voice_of("::1", team_id=None, ungrouped=LOCAL) is None
    assert voices.voice_of("testclient", team_id=None, ungrouped=LOCAL) is None
    assert voices.voice_of(None, team_id=None, ungrouped=LOCAL) is None
    lab = voices.networks("10.0.0.0/8")
    assert voices.voice_of("10.1.2.3", team_id=None, ungrouped=lab) is None


def test_a_bad_network_is_named():
    with pytest.raises(ValueError, match="'nope' is not an address"):
        voices.networks("127.0.0.1, nope")


def test_a_voice_s_members_share_one_worker_s_weight(tmp_path):
    from coordinator.runtime import RunRuntime
    from coordinator.storage import Storage
    from shared.config import RunConfig
    from shared.model import ModelConfig

    cfg = RunConfig(name="v", model=ModelConfig(n_layer=1, d_model=16, n_head=2, context=8))
    rt = RunRuntime.fresh(run_id=1, config=cfg, storage=Storage.local(tmp_path))
    assert rt._voice_share(None, "1") == 1.0
    assert [rt._voice_share("@x", w) for w in ("5", "6", "5", "7", "8")] == [1.0, 0.5, 0.5, 1 / 3, 0.25]
    assert rt._voice_share("@y", "9") == 1.0  # another address: a voice of its own
    assert RunRuntime(run_id=1, config=cfg, storage=rt.storage, state=rt.state, version=0,
                      screen=rt.screen_json()).voices == rt.voices  # checkpointed
