"""shared/kernels.py: the compiled loops compute exactly what their numpy/torch paths compute."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import kernels
from shared.algorithms.flat_outer import FlatOuter
from shared.algorithms.outer import OuterState
from shared.codec import FlatDelta, seeded_indices, seeded_indices_many
from shared.codec.indices import _seeded_indices_numpy
from shared.config import OuterConfig

MASK64 = (1 << 64) - 1


def test_numba_is_installed_where_the_tests_run():
    # a dependency: without it the suite would compare the fallback with itself
    assert kernels.HAVE_NUMBA and kernels.ready()


def test_a_broken_numba_leaves_the_kernels_off_and_the_plain_paths_on(monkeypatch, caplog):
    def broken() -> None:
        raise ImportError("numba: no module named llvmlite")

    monkeypatch.setattr(kernels, "_ready", None)
    monkeypatch.setattr(kernels, "_compile", broken)
    assert not kernels.ready() and not kernels.ready()  # tried once, then remembered
    assert "compiled kernels unavailable (ImportError" in caplog.text
    # everything still answers, through numpy/torch
    np.testing.assert_array_equal(seeded_indices(42, 200, 20), _seeded_indices_numpy(42, 200, 20))
    t, m = torch.zeros(4), torch.zeros(4)
    kernels.scatter_pair(t, m, torch.tensor([1, 1]), torch.ones(2), 2.0, 3.0)
    assert t[1] == 4.0 and m[1] == 6.0
    with pytest.raises(RuntimeError, match="only when ready"):
        kernels.first_distinct_sorted([1], [100], [3], [0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, MASK64), st.integers(4, 1 << 62), st.integers(1, 400)),
                min_size=1, max_size=6), st.data())
def test_first_distinct_sorted_is_the_spec(specs, data):
    # numels up to 2^62 exercise the remainder by multiply-high far from small numbers
    seeds = [s for s, _, _ in specs]
    numels = [n for _, n, _ in specs]
    ks = [min(k, n // 4) for _, n, k in specs]
    offsets = [data.draw(st.integers(0, 1 << 40)) for _ in specs]
    want = np.concatenate([_seeded_indices_numpy(s, n, k) + o for s, n, k, o in zip(seeds, numels, ks, offsets)])
    got = kernels.first_distinct_sorted(seeds, numels, ks, offsets)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("numel", [4, 5, 7, 8, 1000, 2**31 - 1, 2**31, 2**32 + 1, 2**63 - 1])
def test_first_distinct_sorted_edges(numel):
    # collisions at k = numel / 4 on tiny tensors, the 32-bit boundaries, and the largest int64 numel
    k = min(numel // 4, 300)
    for seed in (0, 1, MASK64, 0x9E3779B97F4A7C15):
        np.testing.assert_array_equal(kernels.first_distinct_sorted([seed], [numel], [k], [0]),
                                      _seeded_indices_numpy(seed, numel, k))


def test_seeded_indices_many_refuses_mismatched_arguments_on_both_paths():
    for ctx in (kernels.disabled, contextlib.nullcontext):
        with ctx():
            with pytest.raises(ValueError, match="offsets must have one entry per seed"):
                seeded_indices_many([1, 2], [100, 100], [3, 3], [0])
            with pytest.raises(ValueError, match="same length"):
                seeded_indices_many([1, 2], [100], [3, 3])


def test_first_distinct_sorted_refuses_dense_draws():
    with pytest.raises(ValueError, match="sparse"):
        kernels.first_distinct_sorted([1], [10], [3], [0])  # 4k > numel: the other branch of the spec
    with pytest.raises(ValueError, match="same length"):
        kernels.first_distinct_sorted([1, 2], [100], [3], [0])


def test_the_numpy_path_gives_the_same_indices():
    rng = np.random.default_rng(5)
    seeds = [int(s) for s in rng.integers(0, 2**63, size=40)]
    numels = [int(n) for n in rng.integers(1, 200_000, size=40)]
    ks = [max(0, int(n * f)) for n, f in zip(numels, rng.uniform(0, 0.4, size=40))]
    fast = seeded_indices_many(seeds, numels, ks, np.cumsum([0] + numels)[:-1])
    single = [seeded_indices(s, n, k) for s, n, k in zip(seeds, numels, ks)]
    with kernels.disabled():
        assert not kernels.HAVE_NUMBA and not kernels.ready()
        plain = seeded_indices_many(seeds, numels, ks, np.cumsum([0] + numels)[:-1])
        assert all(np.array_equal(a, seeded_indices(s, n, k)) for a, s, n, k in zip(single, seeds, numels, ks))
    assert kernels.HAVE_NUMBA
    np.testing.assert_array_equal(fast, plain)
    # tiny tensors at k = numel / 4 collide often, and some need more draws than the first batch
    seeds = list(range(500))
    fast = seeded_indices_many(seeds, [8] * 500, [2] * 500)
    with kernels.disabled():
        np.testing.assert_array_equal(seeded_indices_many(seeds, [8] * 500, [2] * 500), fast)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 5000), st.floats(-4, 4), st.floats(-4, 4), st.integers(0, 2**32 - 1))
def test_scatter_pair_is_two_index_adds_bit_for_bit(n, k, a, b, seed):
    g = torch.Generator().manual_seed(seed)
    t, m = torch.randn(n, generator=g), torch.randn(n, generator=g)
    idx = torch.randint(0, n, (k,), generator=g)  # repeats included: order of accumulation matters
    vals = torch.randn(k, generator=g) * 1e3
    t2, m2 = t.clone(), m.clone()
    m2.index_add_(0, idx, vals, alpha=b)
    t2.index_add_(0, idx, vals, alpha=a)
    kernels.scatter_pair(t, m, idx, vals, a, b)
    assert torch.equal(t, t2) and torch.equal(m, m2)


def test_scatter_pair_refuses_bad_indices_and_writes_nothing():
    t, m = torch.zeros(10), torch.zeros(10)
    with pytest.raises(IndexError, match="index 10 out of range"):
        kernels.scatter_pair(t, m, torch.tensor([1, 2, 10]), torch.ones(3), 1.0, 1.0)
    with pytest.raises(IndexError, match="index -1"):
        kernels.scatter_pair(t, m, torch.tensor([-1, 2]), torch.ones(2), 1.0, 1.0)
    assert not t.any() and not m.any()
    with pytest.raises(ValueError, match="2 indices for 3 values"):
        kernels.scatter_pair(t, m, torch.tensor([1, 2]), torch.ones(3), 1.0, 1.0)


def test_scatter_pair_other_layouts_take_index_add():
    t, m = torch.zeros(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    kernels.scatter_pair(t, m, torch.tensor([1, 1]), torch.ones(2, dtype=torch.float64), 2.0, 3.0)
    assert t[1] == 4.0 and m[1] == 6.0


def _lazy_run(cfg: OuterConfig, n: int, deltas: int, seed: int) -> FlatOuter:
    g = torch.Generator().manual_seed(seed)
    state = OuterState.fresh({"w": torch.randn(n, generator=g)})
    flat = FlatOuter.from_state(state, lazy=True)
    rng = np.random.default_rng(seed)
    for _ in range(deltas):
        idx = np.sort(rng.choice(n, size=n // 10, replace=False)).astype(np.int64)
        vals = rng.normal(size=idx.size).astype(np.float32)
        flat.apply(FlatDelta(0, 1, idx, vals, ()), weight=0.7, cfg=cfg)
    return flat


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_lazy_momentum_step_is_the_same_with_and_without_the_kernel(nesterov):
    # many groups: momentum steps, folds and rescales all happen on both paths
    cfg = OuterConfig(group=3, momentum=0.2, lr=0.7, nesterov=nesterov)
    fast = _lazy_run(cfg, 5000, 40, seed=3)
    with kernels.disabled():
        plain = _lazy_run(cfg, 5000, 40, seed=3)
    assert torch.equal(fast.t, plain.t) and torch.equal(fast.m, plain.m)
    assert (fast.scale, fast.carry, fast.in_group) == (plain.scale, plain.carry, plain.in_group)


def test_ready_compiles_every_kernel():
    assert kernels.ready()
    assert set(kernels._compiled) == {"first_distinct_sorted", "scatter_pair", "unpack_packed"}
    with kernels.disabled():
        assert not kernels.ready()  # a no-op without numba


def test_a_kernel_lets_other_threads_run():
    # the merging process's request threads must not wait out a scatter (the GIL is released)
    import threading
    import time

    assert kernels.ready()
    n = 1 << 22
    t, m = torch.zeros(n), torch.zeros(n)
    idx = torch.randint(0, n, (1 << 24,))  # ~0.1 s of scattering
    vals = torch.ones(1 << 24)
    ticks = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=ticker)
    th.start()
    time.sleep(0.01)
    t0 = time.perf_counter()
    kernels.scatter_pair(t, m, idx, vals, 1.0, 1.0)
    t1 = time.perf_counter()
    stop.set()
    th.join()
    during = [x for x in ticks if t0 < x < t1]
    assert t1 - t0 > 0.03  # long enough to tell
    assert len(during) >= 3, f"the ticker ran {len(during)} times in {1000 * (t1 - t0):.0f} ms"
