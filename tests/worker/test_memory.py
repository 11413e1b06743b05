"""worker/memory.py: the worker's own cap on the model it trains, from made-up machines' memory."""

from __future__ import annotations

import pytest
import torch

from shared.model import ModelConfig
from worker import memory
from worker.memory import Memory

GB = 10**9


def test_the_default_cap_is_the_parameters_whose_training_state_fills_a_share_of_available_memory():
    # 8 GB available: 0.6 of it usable, 0.75 of that for 28 bytes per parameter
    assert memory.default_max_params(Memory(total_ram=16 * GB, available_ram=8 * GB)) == \
        int(8 * GB * 0.6 * 0.75) // 28 == 128_571_428


def test_the_default_cap_grows_with_available_memory_not_total():
    busy = memory.default_max_params(Memory(total_ram=64 * GB, available_ram=4 * GB))
    idle = memory.default_max_params(Memory(total_ram=64 * GB, available_ram=48 * GB))
    assert busy * 12 == pytest.approx(idle, rel=1e-6)
    assert busy < 2_000_000_000  # the old fixed default, which a 4 GB-free laptop could never train


def test_an_accelerator_smaller_than_the_ram_bounds_the_cap():
    ram_only = memory.default_max_params(Memory(total_ram=256 * GB, available_ram=200 * GB))
    with_gpu = memory.default_max_params(Memory(total_ram=256 * GB, available_ram=200 * GB, device=24 * GB))
    assert with_gpu == int(24 * GB * 0.6 * 0.75) // 28 < ram_only


def test_unknown_memory_falls_back_to_half_the_total_then_to_a_small_laptop():
    assert memory.default_max_params(Memory(total_ram=16 * GB, available_ram=None)) == \
        memory.default_max_params(Memory(total_ram=None, available_ram=8 * GB))
    fallback = memory.default_max_params(Memory(total_ram=None, available_ram=None))
    assert fallback == int(memory.FALLBACK_TOTAL_BYTES // 2 * 0.6 * 0.75) // 28
    assert memory.default_max_params(Memory(total_ram=0, available_ram=0)) == fallback


def test_the_budget_bounds_activations_at_the_lease_batch_and_context():
    small = ModelConfig()  # 0.64M parameters
    assert memory.lease_too_big(small, batch_size=16, max_params=1_000_000) is None
    long = ModelConfig(context=65536)
    why = memory.lease_too_big(long, batch_size=4096, max_params=1_000_000_000)
    assert why is not None and "batch 4096 x context 65536" in why and "--max-params" in why
    # the same lease fits a cap large enough for its activations
    need = memory.round_bytes(long.n_params(), long, batch_size=4096)
    assert memory.lease_too_big(long, batch_size=4096, max_params=need // 28 + 1) is None


def test_a_model_over_the_cap_is_named_with_its_size_and_the_flag():
    cfg = ModelConfig(n_layer=48, n_head=26, d_model=1664, context=1024)
    why = memory.lease_too_big(cfg, batch_size=1, max_params=128_571_428)
    assert why == (f"its model has {cfg.n_params():,} parameters, above this worker's limit of 128,571,428 "
                   "(--max-params or --max-memory; the default comes from this machine's memory)")


def test_the_download_cap_is_the_largest_snapshot_the_cap_allows_or_a_shard():
    assert memory.download_cap_bytes(1_000) == memory.MAX_SHARD_BYTES
    assert memory.download_cap_bytes(2_000_000_000) == 8 * GB + memory.SNAPSHOT_SLACK_BYTES


def test_meminfo_is_read_in_kilobytes():
    text = "MemTotal:       16303428 kB\nMemFree:  1000 kB\nMemAvailable:    8123456 kB\nBuffers: x kB\n"
    assert memory.parse_meminfo(text) == (16303428 * 1024, 8123456 * 1024)
    assert memory.parse_meminfo("garbage") == (None, None)


def test_probe_reads_this_machine():
    mem = memory.probe(torch.device("cpu"))
    assert mem.device is None
    assert memory.default_max_params(mem) >= 1


# -- either architecture ------------------------------------------------------------------------

def _saved_for_backward(cfg: ModelConfig, batch_size: int) -> int:
    """Bytes of the tensors autograd keeps for backward in one forward pass (weights excluded):
    the activations, measured, as the reference the estimate must cover."""
    from shared.model import build_model

    model = build_model(cfg)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            storages[ptr] = max(storages.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.context))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(storages.values())


@pytest.mark.parametrize("cfg", [
    ModelConfig(),  # the demo's GPT
    ModelConfig(arch="llama"),
    ModelConfig(arch="llama", n_head=8, n_kv_head=2, d_model=256, vocab_size=512, context=64),
    ModelConfig(arch="llama", n_head=4, n_kv_head=1, d_model=128, ffn_hidden=512, context=64, tie_embeddings=False),
])
def test_the_activation_estimate_covers_what_autograd_keeps_without_doubling_it(cfg):
    measured = _saved_for_backward(cfg, batch_size=4)
    estimate = memory.activation_bytes(cfg, batch_size=4)
    assert measured <= estimate <= 2 * measured


def test_grouped_query_attention_and_a_narrower_mlp_need_less():
    mha = ModelConfig(arch="llama", n_head=8, d_model=256)
    assert memory.activation_bytes(ModelConfig(arch="llama", n_head=8, n_kv_head=2, d_model=256), batch_size=8) < \
        memory.activation_bytes(mha, batch_size=8)
    assert memory.activation_bytes(ModelConfig(arch="llama", n_head=8, d_model=256, ffn_hidden=256), batch_size=8) < \
        memory.activation_bytes(mha, batch_size=8)


def test_a_llama_model_over_the_cap_is_named_with_its_exact_size():
    cfg = ModelConfig.preset("llama-60m")
    why = memory.lease_too_big(cfg, batch_size=1, max_params=50_000_000)
    assert why is not None and f"its model has {cfg.n_params():,} parameters" in why and "58,073,600" in why
    assert memory.lease_too_big(ModelConfig.preset("llama-tiny"), batch_size=16, max_params=1_000_000) is None


@pytest.mark.parametrize("cfg,batch", [
    (ModelConfig.preset("small"), 16),
    (ModelConfig.preset("small"), 1),
    (ModelConfig(), 16),  # fits the smallest budget: the parameter count is the bound
    (ModelConfig(context=65536), 64),
])
def test_min_max_params_is_the_smallest_cap_a_lease_fits(cfg, batch):
    m = memory.min_max_params(cfg, batch_size=batch)
    assert memory.lease_too_big(cfg, batch_size=batch, max_params=m) is None
    assert memory.lease_too_big(cfg, batch_size=batch, max_params=m - 1) is not None
    # a worker whose free memory is free_ram_for(m) gets that cap by default
    assert memory.default_max_params(Memory(total_ram=None, available_ram=memory.free_ram_for(m))) >= m


def test_the_group_normalised_adamw_is_sized_with_its_two_more_tensors():
    cfg = ModelConfig(n_layer=24, n_head=16, d_model=1024, context=1024)  # sized on paper: nothing allocated
    n = cfg.n_params()
    plain = memory.round_bytes(n, cfg, batch_size=16)
    assert memory.round_bytes(n, cfg, batch_size=16, group_adamw=True) == plain + 8 * n
    lo, hi = n, 100 * n  # the smallest cap that holds a round of AdamW...
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if memory.lease_too_big(cfg, batch_size=16, max_params=mid) is None else (mid + 1, hi)
    assert memory.lease_too_big(cfg, batch_size=16, max_params=lo) is None
    why = memory.lease_too_big(cfg, batch_size=16, max_params=lo, group_adamw=True)  # ...holds no round of it
    assert why is not None and "--max-params" in why
