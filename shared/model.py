"""The model every worker trains: a decoder-only transformer, GPT-2's block (`arch = "gpt"`, the
default) or a Llama-style one (`arch = "llama"`: RMSNorm, rotary positions, SwiGLU; shared/llama.py).

Sized by default (3 layers, width 128, context 128, byte tokens: about 0.64M parameters) to train
usefully on one CPU core, the same shape as the public SPARTA/DiLoCo measurements in
docs/references.md. Named presets (PRESETS: `tiny`, `llama-tiny`, `small`, `llama-60m`,
`gpt2-124m`) give recognisable sizes: `model = {preset = "small"}` in a run config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.llama import LlamaLM

MAX_PARAMS = 20_000_000_000  # beyond anything a volunteer round can hold; workers set their own, lower cap
MAX_VOCAB = 1 << 22  # shards hold uint16 tokens up to 65,536 and uint32 above (shared/data.py)
ARCHS = ("gpt", "llama")
LLAMA_ONLY = {"n_kv_head": None, "ffn_hidden": None, "tie_embeddings": True, "rope_theta": 10000.0}

# Named sizes (ModelConfig fields; a run config's own keys override them).
PRESETS: dict[str, dict] = {
    # the demo's model: GPT-2's block over bytes, 644,224 parameters
    "tiny": dict(arch="gpt", vocab_size=256, n_layer=3, n_head=4, d_model=128, context=128),
    # the same size with the Llama-style block, 672,640 parameters
    "llama-tiny": dict(arch="llama", vocab_size=256, n_layer=3, n_head=4, d_model=128, context=128),
    # ~20M (20,848,512): a BPE vocabulary of 8192 (`idletrain data prepare --vocab-size 8192`)
    "small": dict(arch="llama", vocab_size=8192, n_layer=10, n_head=6, d_model=384, context=512),
    # GaLore's LLaMA-60M shape (58,073,600 with a 32,000-token vocabulary, untied head)
    "llama-60m": dict(arch="llama", vocab_size=32000, n_layer=8, n_head=8, d_model=512, context=1024,
                      ffn_hidden=1376, tie_embeddings=False),
    # GPT-2 small's shape exactly (124,439,808; exports to transformers' GPT2LMHeadModel)
    "gpt2-124m": dict(arch="gpt", vocab_size=50257, n_layer=12, n_head=12, d_model=768, context=1024),
}


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # byte-level tokens by default: no tokenizer to ship or download
    n_layer: int = 3
    n_head: int = 4
    d_model: int = 128
    context: int = 128  # tokens per training sequence
    dropout: float = 0.0  # volunteers' rounds are short; dropout only slows them
    arch: str = "gpt"  # "gpt" (learned positions, LayerNorm, GELU, biases) or "llama"
    n_kv_head: int | None = None  # llama: key/value heads (grouped-query attention); None = n_head
    ffn_hidden: int | None = None  # llama: SwiGLU's hidden width; None = 8/3 d_model, rounded up to 64
    tie_embeddings: bool = True  # the output head is the embedding matrix (gpt: always)
    rope_theta: float = 10000.0  # llama: the rotary embeddings' base
    norm_eps: float = 1e-5  # LayerNorm's (gpt) or RMSNorm's (llama) epsilon

    def __post_init__(self) -> None:
        for field in ("vocab_size", "n_layer", "n_head", "d_model", "context"):
            _positive_int(field, getattr(self, field))
        for field in ("dropout", "rope_theta", "norm_eps"):
            value = getattr(self, field)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, field, float(value))  # TOML's `rope_theta = 10000`
            elif not isinstance(value, float):
                raise ValueError(f"ModelConfig.{field} must be a number, got {value!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"ModelConfig.arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if self.vocab_size > MAX_VOCAB:
            raise ValueError(f"ModelConfig.vocab_size ({self.vocab_size:,}) is above the limit of {MAX_VOCAB:,}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 < self.norm_eps < 1.0:
            raise ValueError(f"ModelConfig.norm_eps must be in (0, 1), got {self.norm_eps}")
        if self.n_layer > 512 or self.d_model > 65536 or self.n_head > 4096 or self.context > 1 << 20:
            raise ValueError("ModelConfig is out of range: n_layer <= 512, d_model <= 65536, n_head <= 4096, "
                             "context <= 1048576")
        if self.arch == "llama":
            self._check_llama()
        else:
            for field, default in LLAMA_ONLY.items():
                if getattr(self, field) != default:
                    raise ValueError(f"ModelConfig.{field} applies to arch 'llama' only (this model's arch is "
                                     f"'gpt'); remove it or set arch = 'llama'")
        if self.n_params() > MAX_PARAMS:
            raise ValueError(f"ModelConfig describes {self.n_params():,} parameters, above the limit of "
                             f"{MAX_PARAMS:,}")

    def _check_llama(self) -> None:
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: rotary embeddings need an even head size; d_model / n_head = "
                             f"{self.d_model} / {self.n_head} = {self.head_dim}")
        if self.n_kv_head is not None:
            _positive_int("n_kv_head", self.n_kv_head)
            if self.n_head % self.n_kv_head:
                raise ValueError(f"ModelConfig.n_head ({self.n_head}) must be a multiple of n_kv_head "
                                 f"({self.n_kv_head})")
        if self.ffn_hidden is not None:
            _positive_int("ffn_hidden", self.ffn_hidden)
            if self.ffn_hidden > 1 << 20:
                raise ValueError(f"ModelConfig.ffn_hidden must be <= 1048576, got {self.ffn_hidden}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1.0):
            raise ValueError(f"ModelConfig.rope_theta must be a finite number above 1, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn_dim(self) -> int:
        """The MLP's hidden width: 4 d_model (gpt); ffn_hidden or 8/3 d_model rounded up to 64 (llama)."""
        if self.arch == "gpt":
            return 4 * self.d_model
        return self.ffn_hidden or 64 * math.ceil(8 * self.d_model / 3 / 64)

    def n_params(self) -> int:
        """The parameter count of build_model(self), computed without building it."""
        d, v = self.d_model, self.vocab_size
        if self.arch == "llama":
            kv = self.kv_heads * self.head_dim
            per_block = 2 * d * d + 2 * d * kv + 3 * d * self.ffn_dim + 2 * d
            return v * d * (1 if self.tie_embeddings else 2) + self.n_layer * per_block + d
        per_block = 12 * d * d + 13 * d
        return v * d + self.context * d + self.n_layer * per_block + 2 * d

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> ModelConfig:
        """The config from its dict; a `preset` key names one of PRESETS, the other keys override it."""
        data = dict(data)
        preset = data.pop("preset", None)
        if preset is not None:
            if preset not in PRESETS:
                raise ValueError(f"unknown model preset {preset!r}: choose one of {', '.join(PRESETS)}")
            data = {**PRESETS[preset], **data}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        return cls.from_dict({"preset": name, **overrides})


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
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """The GPT (arch "gpt"): GPT-2's block with exact GELU; transformers' GPT2LMHeadModel with
    activation_function "gelu" computes the same function (idletrain/export.py)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
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


def model_class(cfg: ModelConfig) -> type[TransformerLM] | type[LlamaLM]:
    """The module class of `cfg.arch`: TransformerLM (gpt) or LlamaLM (llama)."""
    return LlamaLM if cfg.arch == "llama" else TransformerLM


def build_model(cfg: ModelConfig, *, seed: int = 0) -> TransformerLM | LlamaLM:
    """A freshly initialised model; the same seed gives the same weights on every machine."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(cfg)(cfg)


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
        return param_schema(model_class(cfg)(cfg))


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
def generate_ids(model: nn.Module, prompt: list[int], *, max_new_tokens: int = 200, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None,
                 allowed: int | None = None) -> list[int]:
    """Continue the token ids `prompt` (not empty); returns only the new ids. temperature 0 is
    greedy; top_k keeps the k likeliest tokens before sampling; `allowed` keeps ids below it only."""
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    if not prompt:
        raise ValueError("the prompt has no tokens")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    out = []
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -model.cfg.context:])
        logits = logits[:, -1, :].float()
        if allowed is not None:
            logits[:, allowed:] = float("-inf")
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
    return out


def generate(model: nn.Module, prompt: bytes, *, max_new_tokens: int = 200, temperature: float = 0.8,
             top_k: int | None = 40, generator: torch.Generator | None = None) -> bytes:
    """Continue `prompt` byte by byte (a model over byte tokens); returns only the new bytes."""
    ids = generate_ids(model, list(prompt) or [ord("\n")], max_new_tokens=max_new_tokens, temperature=temperature,
                       top_k=top_k, generator=generator, allowed=256)  # only byte values decode to text
    return bytes(ids)
