"""How large a model this machine can train: the worker's own cap, never the coordinator's word.

The pure core (`default_max_params`, `round_bytes`, `lease_too_big`, `download_cap_bytes`) takes
memory sizes as numbers, so it is tested with made-up machines; `probe()` reads this machine's.
`worker_max_params` is the one limit the worker runs under: --max-params, else the default from this
machine's memory, and under --max-memory (a volunteer's own cap in bytes) in either case.
A lease's model is sized on the meta device (shared.model.meta_schema) and checked here before
anything of it is downloaded, built or allocated.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import torch

from shared.model import ModelConfig, meta_schema

log = logging.getLogger(__name__)

# What a round holds per parameter, in bytes. Any AdamW trainer needs 16: fp32 weights (4), their
# gradients (4) and AdamW's two moments (exp_avg, exp_avg_sq: 4 + 4). A worker also keeps, in fp32,
# the round's base snapshot (4: the pseudo-gradient is base - local), the error-feedback residual
# (4) and the pseudo-gradient being compressed (4).
BYTES_PER_PARAM = 28
# With inner.second_moment_workers > 1 the optimiser is GroupAdamW (shared/algorithms/group_adamw.py),
# which keeps four fp32 tensors a parameter instead of AdamW's two: 8 bytes more.
GROUP_ADAMW_EXTRA_BYTES_PER_PARAM = 8
# Activations kept for the backward pass, in fp32 values per token per layer per unit of d_model:
# ln1 out (1), qkv (3), attention out (1), its projection (1), ln2 out (1), the MLP's hidden layer
# before and after GELU (4 + 4), its output (1) and the two residual sums (2) = 18, rounded up to 20
# for SDPA's softmax statistics and allocator slack. (The attention matrix itself is not kept: SDPA's
# flash and memory-efficient kernels never materialise it.)
ACTIVATION_VALUES_PER_TOKEN_DIM = 20
# The Llama-style block (shared/llama.py), per token per layer, in units of d_model: the two RMSNorm
# outputs and their fp32 copies (4), q and its rotated copy (2), the attention output (1), its
# projection (1), the two residual sums (2), and 2 for SDPA's statistics and slack = 12; in units of
# the key/value width (n_kv_head * head_dim): k, v and rotated k (3, and the repeated copies under
# grouped-query attention, 2 n_head / n_kv_head - 2 more); in units of the SwiGLU width: gate, its
# SiLU, up and their product (4).
LLAMA_VALUES_PER_TOKEN_DIM = 12
LLAMA_VALUES_PER_TOKEN_FFN = 4
# The logits (B, T, vocab) live three times: the logits, their log-softmax, and its gradient.
LOGIT_COPIES = 3
# Share of the memory available at start that training may take: the OS, the page cache and the
# user's own programs keep the rest (a volunteer's machine is not ours).
USABLE_SHARE = 0.6
# Share of that budget the default cap gives the parameters (BYTES_PER_PARAM each); the rest is for
# a round's activations (batch * context tokens) and the transient copies of a download.
PARAM_SHARE = 0.75
MIN_BUDGET_BYTES = 1 << 30  # a cap set very low still leaves room for a small model's activations
FALLBACK_TOTAL_BYTES = 4 << 30  # when this machine's memory cannot be read: a small laptop's
SNAPSHOT_SLACK_BYTES = 16 << 20  # safetensors header (names, shapes) and zstd framing above 4 B/param
MAX_SHARD_BYTES = (1 << 30) + (16 << 20)  # RunConfig.shard_tokens <= 2^30 bytes, plus zstd's worst-case framing


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes of this machine's memory; None where it could not be read."""

    total_ram: int | None
    available_ram: int | None
    device: int | None = None  # the accelerator's (CUDA, MPS) when the model trains there


def usable_bytes(mem: Memory) -> int:
    """The bytes a round may take: USABLE_SHARE of the RAM available now (of half the total when
    'available' is unknown), and on an accelerator no more than that share of its memory too (the
    model, gradients and optimiser live there; the base and residual copies stay in RAM)."""
    if mem.available_ram is not None and mem.available_ram > 0:
        ram = mem.available_ram
    elif mem.total_ram is not None and mem.total_ram > 0:
        ram = mem.total_ram // 2
    else:
        ram = FALLBACK_TOTAL_BYTES // 2
    usable = int(ram * USABLE_SHARE)
    if mem.device is not None and mem.device > 0:
        usable = min(usable, int(mem.device * USABLE_SHARE))
    return max(usable, 1)


def default_max_params(mem: Memory) -> int:
    """The --max-params default: the parameters whose training state (BYTES_PER_PARAM each) fills
    PARAM_SHARE of the usable memory. 16 GB available on CPU: 9.6 GB usable, 257M parameters."""
    return max(1, int(usable_bytes(mem) * PARAM_SHARE) // BYTES_PER_PARAM)


def budget_bytes(max_params: int) -> int:
    """The bytes a round may take under a cap of `max_params`: the cap's share (PARAM_SHARE) of a
    budget, so context, batch size and downloads are bounded by the same one number."""
    return max(MIN_BUDGET_BYTES, math.ceil(max_params * BYTES_PER_PARAM / PARAM_SHARE))


def layer_values_per_token(cfg: ModelConfig) -> int:
    """fp32 values one layer keeps per token for the backward pass, for cfg's architecture."""
    if cfg.arch == "llama":
        kv = cfg.kv_heads * cfg.head_dim
        repeated = 2 * (cfg.n_head // cfg.kv_heads - 1) * kv  # grouped-query attention's repeated k and v
        return LLAMA_VALUES_PER_TOKEN_DIM * cfg.d_model + 3 * kv + repeated + LLAMA_VALUES_PER_TOKEN_FFN * cfg.ffn_dim
    return ACTIVATION_VALUES_PER_TOKEN_DIM * cfg.d_model


def activation_bytes(cfg: ModelConfig, *, batch_size: int) -> int:
    """Bytes of activations one local step keeps for its backward pass (fp32)."""
    tokens = batch_size * cfg.context  # (B, T)
    per_token = cfg.n_layer * layer_values_per_token(cfg) + LOGIT_COPIES * cfg.vocab_size
    return 4 * tokens * per_token


def round_bytes(n_params: int, cfg: ModelConfig, *, batch_size: int, group_adamw: bool = False) -> int:
    """Bytes a round of `cfg` at `batch_size` sequences per step takes, all told (group_adamw: the run's
    inner.second_moment_workers is above 1, and its optimiser keeps two more tensors)."""
    per_param = BYTES_PER_PARAM + (GROUP_ADAMW_EXTRA_BYTES_PER_PARAM if group_adamw else 0)
    return n_params * per_param + activation_bytes(cfg, batch_size=batch_size)


def snapshot_bytes(n_params: int) -> int:
    """The most a snapshot of `n_params` parameters can weigh on the wire (fp32, zstd never grows
    data by more than its framing): what a download of one is capped at."""
    return 4 * n_params + SNAPSHOT_SLACK_BYTES


def download_cap_bytes(max_params: int) -> int:
    """The client's cap on any one answer: the largest snapshot the cap allows, or the largest shard."""
    return max(snapshot_bytes(max_params), MAX_SHARD_BYTES)


def lease_too_big(cfg: ModelConfig, *, batch_size: int, max_params: int, group_adamw: bool = False) -> str | None:
    """Why a lease of `cfg` at `batch_size` does not fit a worker capped at `max_params` (None: it
    fits). The model is sized on the meta device: nothing is allocated, however large it claims to be."""
    n = sum(math.prod(shape) for shape in meta_schema(cfg).values())
    if n > max_params:
        return (f"its model has {n:,} parameters, above this worker's limit of {max_params:,} (--max-params or "
                f"--max-memory; the default comes from this machine's memory)")
    need, budget = round_bytes(n, cfg, batch_size=batch_size, group_adamw=group_adamw), budget_bytes(max_params)
    if need > budget:
        return (f"a round of its model at batch {batch_size} x context {cfg.context} needs about "
                f"{need / 1e9:.1f} GB ({n:,} parameters plus activations), above the {budget / 1e9:.1f} GB this "
                f"worker's limit of {max_params:,} parameters allows (raise --max-params or --max-memory if "
                f"this machine holds it)")
    return None


def params_within(max_memory_bytes: int) -> int:
    """The largest cap whose round budget (budget_bytes) stays within `max_memory_bytes`: leases are
    refused and micro-batches picked (worker/fit.py) by that budget, so a round stays within it."""
    m = max(1, int(max_memory_bytes * PARAM_SHARE) // BYTES_PER_PARAM)
    while m > 1 and budget_bytes(m) > max_memory_bytes:  # float rounding
        m -= 1
    return m


def worker_max_params(max_params: int | None, max_memory_bytes: int | None, probe_memory) -> int:
    """The worker's limit: `max_params` (--max-params), else default_max_params(probe_memory()), and
    no more than params_within(max_memory_bytes) (--max-memory) when that is set. Says once, in the
    log, where the limit comes from."""
    limit = max_params if max_params is not None else default_max_params(probe_memory())
    source = "--max-params" if max_params is not None else "this machine's available memory"
    if max_memory_bytes is not None and params_within(max_memory_bytes) < limit:
        limit, source = params_within(max_memory_bytes), f"--max-memory {max_memory_bytes / 1e9:.1f} GB"
    if source != "--max-params":
        log.info("training models of up to %s parameters (from %s; --max-params or --max-memory set another "
                 "limit)", f"{limit:,}", source)
    return limit


def min_max_params(cfg: ModelConfig, *, batch_size: int) -> int:
    """The smallest --max-params under which a round of `cfg` at `batch_size` sequences per pass fits
    (lease_too_big answers None): what to tell an operator workers need."""
    n = cfg.n_params()
    need = round_bytes(n, cfg, batch_size=batch_size)
    m = n if budget_bytes(n) >= need else max(n, math.ceil(need * PARAM_SHARE / BYTES_PER_PARAM) - 1)
    while budget_bytes(m) < need:
        m += 1
    return m


def free_ram_for(max_params: int) -> int:
    """The free memory at which a CPU worker's default cap (default_max_params) reaches `max_params`."""
    ram = math.ceil(max_params * BYTES_PER_PARAM / PARAM_SHARE / USABLE_SHARE)
    while default_max_params(Memory(total_ram=None, available_ram=ram)) < max_params:  # float rounding
        ram += 16
    return ram


# -- this machine --------------------------------------------------------------------------------

def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo's text (kB lines)."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key in ("MemTotal", "MemAvailable") and parts and parts[0].isdigit():
            found[key] = int(parts[0]) * 1024
    return found.get("MemTotal"), found.get("MemAvailable")


def probe(device: torch.device) -> Memory:
    """This machine's memory (Linux: /proc/meminfo; elsewhere the total from sysconf where it
    exists), and the accelerator's when `device` is one."""
    total = available = None
    try:
        with open("/proc/meminfo") as f:
            total, available = parse_meminfo(f.read())
    except OSError:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            total = None
    dev = None
    try:
        if device.type == "cuda":
            dev = torch.cuda.mem_get_info(device)[0]  # (free, total): what is free now
        elif device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
            dev = int(torch.mps.recommended_max_memory())
    except (RuntimeError, AttributeError) as exc:
        log.debug("cannot read %s memory (%s)", device.type, exc)
    return Memory(total_ram=total, available_ram=available, device=dev)
