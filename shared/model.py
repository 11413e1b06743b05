"""The model every worker trains: a small decoder-only transformer over bytes.

Sized by default (3 layers, width 128, context 128: about 0.64M parameters) to train usefully
on one CPU core, the same shape as the public SPARTA/DiLoCo measurements in docs/references.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F


MAX_PARAMS = 20_000_000_000  # beyond anything a volunteer round can hold; workers set their own, lower cap


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # byte-level tokens: no tokenizer to ship or download
    n_layer: int = 3
    n_head: int = 4
    d_model: int = 128
    context: int = 128  # tokens per training sequence
    dropout: float = 0.0  # volunteers' rounds are short; dropout only slows them

    def __post_init__(self) -> None:
        for field in ("vocab_size", "n_layer", "n_head", "d_model", "context"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{field} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if self.vocab_size > 65536:
            raise ValueError("ModelConfig.vocab_size above 65536 does not fit the uint16 shard format")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.n_layer > 512 or self.d_model > 65536 or self.n_head > 4096 or self.context > 1 << 20:
            raise ValueError("ModelConfig is out of range: n_layer <= 512, d_model <= 65536, n_head <= 4096, "
                             "context <= 1048576")
        if self.n_params() > MAX_PARAMS:
            raise ValueError(f"ModelConfig describes {self.n_params():,} parameters, above the limit of "
                             f"{MAX_PARAMS:,}")

    def n_params(self) -> int:
        """The parameter count of TransformerLM(self), computed without building it."""
        d = self.d_model
        per_block = 12 * d * d + 13 * d
        return self.vocab_size * d + self.context * d + self.n_layer * per_block + 2 * d

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**data)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # The output head shares the embedding matrix (weight tying): fewer bytes per delta.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2's scaled init of residual projections keeps early activations bounded.
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.cfg.context:
            raise ValueError(f"sequence of {T} tokens exceeds the model context {self.cfg.context}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(cfg: ModelConfig, *, seed: int = 0) -> TransformerLM:
    """A freshly initialised model; the same seed gives the same weights on every machine."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TransformerLM(cfg)


def param_schema(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every trainable tensor, in the model's order: what a delta may touch."""
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def get_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached fp32 CPU copy of the parameters (never an alias: see docs/references.md)."""
    return {name: p.detach().to("cpu", torch.float32, copy=True) for name, p in model.named_parameters()}


@torch.no_grad()
def set_params(model: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    own = dict(model.named_parameters())
    if set(own) != set(params):
        missing, extra = sorted(set(own) - set(params)), sorted(set(params) - set(own))
        raise ValueError(f"parameter names differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, p in own.items():  # check everything before changing anything
        if tuple(params[name].shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {tuple(params[name].shape)} != model {tuple(p.shape)}")
    for name, p in own.items():
        p.copy_(params[name])


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_schema(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """param_schema(build_model(cfg)) without allocating a byte of weights: the model is built on
    the meta device (shapes only), so a worker sizes a coordinator's model before holding it."""
    with torch.device("meta"):
        return param_schema(TransformerLM(cfg))


@torch.no_grad()
def evaluate_loss(model: nn.Module, tokens: torch.Tensor, *, context: int, batch_size: int = 32,
                  max_sequences: int | None = None) -> float:
    """Mean next-token loss (nats per token) over non-overlapping windows of `tokens` (1-D)."""
    n_seq = (tokens.numel() - 1) // context
    if max_sequences is not None:
        n_seq = min(n_seq, max_sequences)
    if n_seq < 1:
        raise ValueError(f"eval split of {tokens.numel()} tokens is shorter than one context window")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    starts = torch.arange(n_seq) * context
    offsets = torch.arange(context + 1)
    for i in range(0, n_seq, batch_size):
        window = tokens[(starts[i:i + batch_size, None] + offsets).clamp_max(tokens.numel() - 1)]
        window = window.long().to(device)  # (b, T+1)
        _, loss = model(window[:, :-1], window[:, 1:])
        total += loss.item() * window.shape[0]
        count += window.shape[0]
    model.train(was_training)
    return total / count


@torch.no_grad()
def generate(model: TransformerLM, prompt: bytes, *, max_new_tokens: int = 200, temperature: float = 0.8,
             top_k: int | None = 40, generator: torch.Generator | None = None) -> bytes:
    """Continue `prompt` byte by byte (the model's tokens are bytes); returns only the new bytes.

    temperature 0 is greedy; top_k keeps the k likeliest bytes before sampling."""
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    idx = torch.tensor([list(prompt) or [ord("\n")]], dtype=torch.long, device=device)
    out = []
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.cfg.context:])
        logits = logits[:, -1, :].float()
        logits[:, 256:] = float("-inf")  # only byte values decode to text
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
        out.append(int(nxt.item()))
    model.train(was_training)
    return bytes(out)
