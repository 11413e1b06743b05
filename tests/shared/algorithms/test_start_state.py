"""A round's start state: its bytes are deterministic and checked as untrusted input, AdamW's moment
bound holds for any gradients, and a replay from the committed state passes an honest later round
while failing another worker's delta of the same base, which passed the check without it."""

from __future__ import annotations

import math
import random

import pytest
import safetensors.torch
import torch

from shared.algorithms import spotcheck as sc
from shared.algorithms import start_state
from shared.config import InnerConfig
from shared.model import build_model, param_schema

pytestmark = pytest.mark.usefixtures("one_torch_thread")

bench = pytest.importorskip("bench.spotcheck")
SCHEMA = bench.SCHEMA
LIMIT = start_state.max_bytes(SCHEMA)


@pytest.fixture(scope="module")
def pairs():
    return bench.trial(3, rounds=3, precision="fp32")


def test_equal_states_give_equal_bytes_and_decode_back(pairs):
    a = pairs[1][0]
    st = start_state.decode(a.start, schema=SCHEMA, limit=LIMIT)
    assert not st.fresh and st.steps_done == bench.INNER.steps and st.residual
    again = start_state.encode(st.optimizer, st.residual, steps_done=st.steps_done)
    assert again == a.start and start_state.sha256(again) == start_state.sha256(a.start)
    assert start_state.incomplete(st, schema=SCHEMA, group=False) is None
    assert start_state.implausible(st, beta1=0.9, beta2=0.95) is None
    fresh = start_state.decode(pairs[0][0].start, schema=SCHEMA, limit=LIMIT)
    assert fresh.fresh and fresh.steps_done == 0


def _tensors(blob: bytes) -> dict[str, torch.Tensor]:
    return dict(safetensors.torch.load(blob))


def _with(blob: bytes, change) -> bytes:
    st = start_state.decode(blob, schema=SCHEMA, limit=LIMIT)
    tensors = _tensors(blob)
    change(tensors)
    meta = {start_state._META_KEY: '{"format": 1, "scalars": {}, "steps_done": %d}' % st.steps_done}
    return safetensors.torch.save(tensors, metadata=meta)


@pytest.mark.parametrize("change, why", [
    (lambda t: t.update({"opt/nope/exp_avg": torch.zeros(3)}), "names no parameter"),
    (lambda t: t.update({"residual/wte.weight": torch.zeros(2, 2)}), "shape"),
    (lambda t: t.update({k: torch.full_like(v, math.nan) for k, v in t.items() if k.endswith("exp_avg")}),
     "not finite"),
    (lambda t: t.update({k: v.double() for k, v in t.items() if k.endswith("exp_avg_sq")}), "float32"),
    (lambda t: t.update({"other/wte.weight": torch.zeros(1)}), "neither an optimizer tensor"),
])
def test_a_malformed_state_is_refused_with_its_reason(pairs, change, why):
    with pytest.raises(ValueError, match=why):
        start_state.decode(_with(pairs[1][0].start, change), schema=SCHEMA, limit=LIMIT)


def test_bytes_that_are_no_state_or_too_many_are_refused(pairs):
    blob = pairs[1][0].start
    for bad in (b"", b"\x00" * 7, (10**9).to_bytes(8, "little") + b"{}", b"\x02\x00\x00\x00\x00\x00\x00\x00{}"):
        with pytest.raises(ValueError):
            start_state.decode(bad, schema=SCHEMA, limit=LIMIT)
    with pytest.raises(ValueError, match="more than"):
        start_state.decode(blob, schema=SCHEMA, limit=len(blob) - 1)


def test_a_state_missing_a_tensor_or_with_two_step_counts_is_incomplete(pairs):
    blob = pairs[1][0].start
    name = next(iter(SCHEMA))
    missing = start_state.decode(_with(blob, lambda t: t.pop(f"opt/{name}/exp_avg_sq")), schema=SCHEMA, limit=LIMIT)
    assert "exp_avg_sq" in start_state.incomplete(missing, schema=SCHEMA, group=False)
    steps = start_state.decode(_with(blob, lambda t: t.update({f"opt/{name}/step": torch.tensor(3.0)})),
                               schema=SCHEMA, limit=LIMIT)
    assert "step counts" in start_state.incomplete(steps, schema=SCHEMA, group=False)
    st = start_state.decode(blob, schema=SCHEMA, limit=LIMIT)
    assert "signal" in start_state.incomplete(st, schema=SCHEMA, group=True)  # GroupAdamW keeps other tensors


def test_adams_first_moment_never_passes_its_bound_and_a_crafted_one_is_refused(pairs):
    """|m| <= moment_bound x sqrt(v) for any gradient sequence (random, constant, alternating, spiky)."""
    b1, b2 = 0.9, 0.95
    bound = start_state.moment_bound(b1, b2)
    assert bound == pytest.approx(1.1650, abs=1e-4) and start_state.moment_bound(0.99, 0.95) == math.inf
    rng = random.Random(0)
    worst = 0.0
    for kind in range(4):
        m = v = 0.0
        for t in range(400):
            g = (rng.gauss(0, 1), 1.0, (-1.0) ** t, 100.0 if t % 37 == 0 else 0.01)[kind] * (1 + (t > 200))
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            worst = max(worst, abs(m) / math.sqrt(v))
    assert worst <= bound
    st = start_state.decode(pairs[1][0].start, schema=SCHEMA, limit=LIMIT)
    name = next(iter(SCHEMA))
    per = st.optimizer.tensors[name]
    per["exp_avg"] = per["exp_avg_sq"].sqrt() * (bound * 1.05)
    assert "first moment" in start_state.implausible(st, beta1=b1, beta2=b2)


def _verdict(r, body: bytes, state: bytes):
    st = start_state.decode(state, schema=SCHEMA, limit=LIMIT)
    pg = sc.replay_round(bench.MODEL, bench.INNER, r.base, r.tokens, lr=bench.LR, seed=r.lease.seed, start=st)
    control = sc.replay_round(bench.MODEL, bench.INNER, r.base, r.control, lr=bench.LR,
                              seed=r.lease.seed ^ sc.CONTROL_SEED, start=st)
    sent = bench.decoded(body)
    values, ref = sc.on_support(sent, pg)
    return sc.compare_committed(values, ref, sc.rounded_on_support(sent, pg), sc.on_support(sent, control)[1])


def test_a_later_round_replayed_from_its_committed_state_passes_and_a_borrowed_one_fails(pairs):
    for a, b in pairs[1:]:
        honest = _verdict(a, a.body, a.start)
        assert honest.passed and honest.cosine > 0.995, honest
        borrowed = _verdict(a, b.body, a.start)
        assert not borrowed.passed, borrowed
        # before the commitment: a fresh-AdamW replay, CARRIED bounds: the borrowed delta passed
        pg = sc.replay_round(bench.MODEL, bench.INNER, a.base, a.tokens, lr=bench.LR, seed=a.lease.seed)
        assert sc.compare(*sc.on_support(bench.decoded(b.body), pg), sc.CARRIED).passed
    crafted = bench.crafted(pairs[2][0].start, pairs[2][1].body, v_scale=50.0)
    assert not _verdict(pairs[2][0], pairs[2][1].body, crafted).passed


def test_the_largest_state_of_a_model_fits_its_bound():
    model = build_model(bench.MODEL)
    schema = param_schema(model)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    from shared.optim_state import optimizer_state
    residual = {n: torch.zeros(s) for n, s in schema.items()}
    blob = start_state.encode(optimizer_state(model, opt), residual, steps_done=10**6)
    assert len(blob) <= start_state.max_bytes(schema)
    assert InnerConfig().beta1 ** 2 < InnerConfig().beta2  # the default betas have a moment bound
