"""worker.state: the local state store (atomic, hashed, no pickle) and the trainer's checkpoints:
a round saved at step k and resumed in fresh objects ends exactly where an uninterrupted one does."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pytest
import torch

from shared import protocol
from shared.algorithms.inner import make_optimizer
from shared.config import CompressionConfig, InnerConfig, SpartaConfig
from shared.model import ModelConfig, build_model, get_params
from worker.state import (
    RoundState,
    StateStore,
    TrainerState,
    decode_state,
    encode_state,
    load_optimizer_state,
    optimizer_state,
    store_key,
)
from worker.trainer import LocalTrainer

MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, context=32)
CPU = torch.device("cpu")



def make_lease(*, algorithm: str = "diloco", lease_id: int = 12, seed: int = 9, steps: int = 6,
               warmup_steps: int = 3, compression: CompressionConfig | None = None) -> protocol.Lease:
    return protocol.Lease(
        lease_id=lease_id, run="t", shard_id=1, shard_sha256="0" * 64, base_version=4, seed=seed, lr=3e-3,
        inner=InnerConfig(steps=steps, batch_size=2, warmup_steps=warmup_steps),
        compression=compression or CompressionConfig(index="topk", fraction=0.1, values="int8"),
        model=MODEL.to_dict(), deadline=datetime(2030, 1, 1, tzinfo=UTC), algorithm=algorithm,
        sparta=SpartaConfig(p=0.2, every=2, alpha=0.5, values="fp32"))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    text = b"the quick brown fox jumps over the lazy dog, again and again. " * 40
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def base_params(seed: int = 0) -> dict[str, torch.Tensor]:
    return get_params(build_model(MODEL, seed=seed))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, dtypes, shapes and bits."""
    return set(a) == set(b) and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


def rand_like(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=gen) for n, t in params.items()}


def sample_state(*, with_round: bool = True) -> TrainerState:
    """A state with every field filled, from a model and optimizer that took a real step."""
    model = build_model(MODEL, seed=3)
    inner = InnerConfig(steps=6, batch_size=2)
    opt = make_optimizer(model, inner)
    x = torch.randint(0, 256, (2, MODEL.context))
    model(x, x)[1].backward()
    opt.step()
    params = get_params(model)
    gen = torch.Generator().manual_seed(5)
    torch.randint(0, 100, (7,), generator=gen)
    rnd = RoundState(lease=make_lease(), step=4, losses=[5.5, 5.25, 5.0, 4.75], generator=gen.get_state(),
                     base=rand_like(params, 1), exchanges_applied={1: 2, 2: 4}) if with_round else None
    return TrainerState(model=MODEL.to_dict(), inner=inner.model_dump(mode="json"), steps_done=17, replica=False,
                        params=params, optimizer=optimizer_state(model, opt), residual=rand_like(params, 2),
                        round=rnd)


# -- the store ------------------------------------------------------------------------------------

def test_every_field_survives_a_round_trip_bit_for_bit(tmp_path):
    store = StateStore(tmp_path, "http://c.test", "t")
    saved = sample_state()
    store.save(saved)
    got = store.load()
    assert got is not None
    assert (got.model, got.inner, got.steps_done, got.replica) == (saved.model, saved.inner, 17, False)
    assert same(got.params, saved.params) and same(got.residual, saved.residual)
    assert set(got.optimizer.tensors) == set(saved.params)
    for name, per_key in saved.optimizer.tensors.items():
        assert set(per_key) == {"step", "exp_avg", "exp_avg_sq"}
        assert same(got.optimizer.tensors[name], per_key)
    assert got.optimizer.groups == saved.optimizer.groups and got.optimizer.scalars == saved.optimizer.scalars
    r, s = got.round, saved.round
    assert r.lease == s.lease and r.step == 4 and r.losses == s.losses
    assert r.exchanges_applied == {1: 2, 2: 4}  # a sparta round's corrections, for its spot-check's replay
    assert torch.equal(r.generator, s.generator) and r.generator.dtype == torch.uint8
    assert same(r.base, s.base)
    # the generator state really restores the sampler
    g1, g2 = torch.Generator(), torch.Generator()
    g1.set_state(s.generator)
    g2.set_state(r.generator)
    assert torch.equal(torch.randint(0, 1000, (5,), generator=g1), torch.randint(0, 1000, (5,), generator=g2))


def test_between_rounds_and_sparta_states_round_trip(tmp_path):
    store = StateStore(tmp_path, "http://c.test", "t")
    store.save(sample_state(with_round=False))
    assert store.load().round is None
    st = sample_state()
    st.round.base, st.replica, st.residual = None, True, {}  # plain sparta: no base, no residual
    store.save(st)
    got = store.load()
    assert got.round.base is None and got.replica is True and got.residual == {}


def test_one_folder_per_coordinator_and_run(tmp_path):
    a = StateStore(tmp_path, "http://c.test", "t")
    assert a.dir == tmp_path / "runs" / store_key("http://c.test", "t")
    assert len({a.dir, StateStore(tmp_path, "http://c.test", "u").dir,
                StateStore(tmp_path, "http://d.test", "t").dir}) == 3
    a.save(sample_state())
    assert StateStore(tmp_path, "http://c.test", "u").load() is None
    assert [p.name for p in a.dir.iterdir()] == ["state.st"]  # no temp file left behind
    assert a.load() is not None
    a.clear()
    assert a.load() is None
    a.clear()  # clearing nothing is fine


def test_the_file_is_hashed_safetensors_and_json(tmp_path):
    store = StateStore(tmp_path, "http://c.test", "t")
    store.save(sample_state())
    blob = store.state_path.read_bytes()
    digest, _, raw = blob.partition(b"\n")
    assert len(digest) == 64
    header_len = int.from_bytes(raw[:8], "little")
    assert b"idletrain.worker_state" in raw[8:8 + header_len]  # JSON metadata in the safetensors header
    assert b"\x80\x04" not in raw[:2]  # not a pickle


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty", "bad-json-in-valid-hash"])
def test_a_corrupt_state_is_ignored_with_a_warning(tmp_path, caplog, damage):
    store = StateStore(tmp_path, "http://c.test", "t")
    store.save(sample_state())
    blob = bytearray(store.state_path.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x40
    elif damage == "truncate":
        blob = blob[: len(blob) // 3]
    elif damage == "garbage":
        blob = bytearray(b"\x00\xffnot a state at all")
    elif damage == "empty":
        blob = bytearray()
    else:  # a correct hash over bytes that are not a state: caught by decoding, not by the hash
        import hashlib
        raw = b"\x10\x00\x00\x00\x00\x00\x00\x00{\"x\": 1}       "
        blob = bytearray(hashlib.sha256(raw).hexdigest().encode() + b"\n" + raw)
    store.state_path.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="worker.state"):
        assert store.load() is None
    assert "unusable" in caplog.text
    assert not store.state_path.exists() and (store.dir / "state.st.corrupt").exists()  # set aside
    assert store.load() is None  # and not reported again
    store.save(sample_state())  # the next checkpoint writes a good one
    assert store.load() is not None


def test_a_state_with_inconsistent_contents_is_refused():
    st = sample_state()
    st.round.losses = st.round.losses[:2]  # 2 losses for 4 steps
    with pytest.raises(ValueError, match="losses"):
        decode_state(encode_state(st))
    st = sample_state()
    st.round.step = 99
    with pytest.raises(ValueError, match="outside"):
        decode_state(encode_state(st))


def test_unsent_delta_round_trip_and_corruption(tmp_path, caplog):
    store = StateStore(tmp_path, "http://c.test", "t")
    assert store.load_unsent() is None
    lease = make_lease(lease_id=31)
    body = bytes(range(256)) * 3 + b"\n\n"  # newlines in the body are fine
    store.save_unsent(lease, body)
    got = store.load_unsent()
    assert got.lease == lease and got.body == body
    raw = bytearray(store.unsent_path.read_bytes())
    raw[-1] ^= 1
    store.unsent_path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="worker.state"):
        assert store.load_unsent() is None
    assert "unusable" in caplog.text
    store.save_unsent(lease, body)
    store.clear_unsent()
    assert store.load_unsent() is None and not store.unsent_path.exists()


# -- the optimizer --------------------------------------------------------------------------------

def test_optimizer_state_loads_into_a_fresh_optimizer():
    saved = sample_state()
    model = build_model(MODEL)
    opt = make_optimizer(model, InnerConfig.model_validate(saved.inner))
    load_optimizer_state(model, opt, saved.optimizer)
    again = optimizer_state(model, opt)
    for name, per_key in saved.optimizer.tensors.items():
        assert same(again.tensors[name], per_key)
    assert again.groups == saved.optimizer.groups


def test_optimizer_state_of_another_model_is_refused():
    saved = sample_state()
    wider = build_model(ModelConfig(n_layer=1, d_model=48, n_head=2, context=32))
    with pytest.raises(ValueError, match="shape"):
        load_optimizer_state(wider, make_optimizer(wider, InnerConfig()), saved.optimizer)
    deeper = build_model(ModelConfig(n_layer=2, d_model=32, n_head=2, context=32))
    saved.optimizer.tensors["not.a.param"] = {"exp_avg": torch.zeros(1)}
    with pytest.raises(ValueError, match="lacks"):
        load_optimizer_state(deeper, make_optimizer(deeper, InnerConfig()), saved.optimizer)


# -- the trainer: interrupted and resumed == uninterrupted ----------------------------------------

def through_disk(state: TrainerState, tmp_path) -> TrainerState:
    store = StateStore(tmp_path, "http://c.test", "t")
    store.save(state)
    return store.load()


@pytest.mark.parametrize("k", [2, 3])
def test_a_resumed_round_ends_exactly_where_an_uninterrupted_one_does(tokens, tmp_path, k):
    lease1, lease2 = make_lease(lease_id=1, seed=1), make_lease(lease_id=2, seed=2, steps=5)
    base1, base2 = base_params(0), base_params(1)

    straight = LocalTrainer(CPU)
    straight.train_round(lease1, base1, tokens)  # a first round: AdamW state, residual, warm-up count
    want = straight.train_round(lease2, base2, tokens)

    first = LocalTrainer(CPU)
    first.train_round(lease1, base1, tokens)
    saves: list[TrainerState] = []
    steps: list[int] = []
    first.train_round(lease2, base2, tokens, checkpoint=saves.append, checkpoint_every=k,
                      on_step=lambda i, _: steps.append(i))
    assert steps == [1, 2, 3, 4, 5]
    assert [s.round.step for s in saves] == list(range(k, 5, k))  # never after the last step
    saved = through_disk(saves[0], tmp_path)
    assert saved.steps_done == 6 and saved.round.step == k and len(saved.round.losses) == k

    fresh = LocalTrainer(CPU)  # a new process: nothing in memory
    fresh.restore_state(saved)
    resumed_steps: list[int] = []
    got = fresh.train_round(saved.round.lease, None, tokens, resume=saved.round,
                            on_step=lambda i, _: resumed_steps.append(i))
    assert resumed_steps == list(range(k + 1, 6))
    assert got.body == want.body  # the same delta, byte for byte
    assert got.losses == want.losses and got.resumed_at == k
    assert got.tokens == (5 - k) * 2 * MODEL.context
    assert same(get_params(fresh.model), get_params(straight.model))
    assert same(fresh.residual, straight.residual)
    assert fresh.steps_done == straight.steps_done == 11
    a, b = optimizer_state(fresh.model, fresh.opt), optimizer_state(straight.model, straight.opt)
    assert all(same(a.tensors[n], b.tensors[n]) for n in b.tensors)


def test_a_state_in_memory_is_a_copy_that_can_be_resumed_twice(tokens):
    lease = make_lease(steps=4)
    trainer = LocalTrainer(CPU)
    saves: list[TrainerState] = []
    want = trainer.train_round(lease, base_params(), tokens, checkpoint=saves.append, checkpoint_every=2)
    for _ in range(2):  # neither the rest of the round nor a resume may change what was exported
        again = LocalTrainer(CPU)
        again.restore_state(saves[0])
        assert again.train_round(lease, None, tokens, resume=saves[0].round).body == want.body


def test_between_rounds_state_continues_the_next_round_exactly(tokens, tmp_path):
    lease1, lease2 = make_lease(lease_id=1, seed=1), make_lease(lease_id=2, seed=2)
    straight = LocalTrainer(CPU)
    straight.train_round(lease1, base_params(0), tokens)
    want = straight.train_round(lease2, base_params(1), tokens)

    before = LocalTrainer(CPU)
    before.train_round(lease1, base_params(0), tokens)
    after = LocalTrainer(CPU)
    after.restore_state(through_disk(before.export_state(), tmp_path))
    assert after.needs_snapshot(lease2)  # diloco resets to every lease's snapshot
    assert after.train_round(lease2, base_params(1), tokens).body == want.body


def test_an_undeliverable_delta_from_disk_goes_back_to_the_residual(tokens):
    tr = LocalTrainer(CPU)
    result = tr.train_round(make_lease(), base_params(), tokens)
    other = LocalTrainer(CPU)
    other.restore_state(tr.export_state())
    tr.undeliverable()
    other.undeliverable_body(result.body)
    assert same(other.residual, tr.residual)


def test_restore_refuses_a_state_that_does_not_fit():
    st = sample_state(with_round=False)
    st.residual = {"nope": torch.zeros(3)}
    tr = LocalTrainer(CPU)
    with pytest.raises(ValueError, match="residual"):
        tr.restore_state(st)
    assert tr.model is None  # nothing half-restored


@pytest.mark.parametrize("algorithm", ["sparta", "sparta+diloco"])
def test_sparta_rounds_resume_without_crashing(tokens, tmp_path, algorithm):
    lease = make_lease(algorithm=algorithm, steps=6)
    calls: list[int] = []

    def exchange(step: int, body: bytes) -> bytes:  # refused like a coordinator that lost the lease's exchanges
        calls.append(step)
        raise ConnectionError("no coordinator here")

    first = LocalTrainer(CPU, exchange_wait_s=1.0)
    saves: list[TrainerState] = []
    first.train_round(lease, base_params(), tokens, exchange=exchange, checkpoint=saves.append, checkpoint_every=3)
    saved = through_disk(saves[0], tmp_path)
    assert saved.round.step == 3
    assert (saved.round.base is None) == (algorithm == "sparta")  # plain sparta ends with an empty delta
    fresh = LocalTrainer(CPU, exchange_wait_s=1.0)
    fresh.restore_state(saved)
    calls.clear()
    result = fresh.train_round(lease, None, tokens, exchange=exchange, resume=saved.round)
    first.close()
    fresh.close()
    assert calls == [4, 6]  # exchanges go on from the resume step
    assert result.exchanges_failed == 2 and len(result.losses) == 6
    if algorithm == "sparta":  # the replica is kept: the next lease needs no snapshot
        assert result.values_sent == 0 and not fresh.needs_snapshot(make_lease(algorithm="sparta", lease_id=13))
    else:
        assert result.values_sent > 0 and fresh.needs_snapshot(make_lease(algorithm=algorithm, lease_id=13))


def test_resume_needs_the_matching_lease_and_a_restored_trainer(tokens):
    lease = make_lease(steps=4)
    saves: list[TrainerState] = []
    LocalTrainer(CPU).train_round(lease, base_params(), tokens, checkpoint=saves.append, checkpoint_every=2)
    with pytest.raises(ValueError, match="restore_state"):
        LocalTrainer(CPU).train_round(lease, None, tokens, resume=saves[0].round)
    tr = LocalTrainer(CPU)
    tr.restore_state(saves[0])
    with pytest.raises(ValueError, match="lease 12"):
        tr.train_round(make_lease(lease_id=99, steps=4), None, tokens, resume=saves[0].round)
