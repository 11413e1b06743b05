"""The Llama-style decoder (ModelConfig.arch == "llama"): RMSNorm, rotary position embeddings (no
learned positions), a SwiGLU MLP, no biases, grouped-query attention (n_kv_head), an optional tied
output head, causal SDPA attention.

It computes what transformers' LlamaForCausalLM computes with the same weights (rotary embeddings
rotate halves, like its rotate_half; RMSNorm in fp32), so idletrain/export.py only renames tensors:
tests/shared/test_llama.py checks the logits against transformers. The block list is `blocks` (an
nn.ModuleList) and each block maps x -> x, like the GPT's, so blocks can be checkpointed alike.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from shared.model import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as LlamaRMSNorm does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary:
    """cos and sin of the rotary angles for positions 0..T-1, (T, head_dim) each, cached per device
    (not a module: no state, nothing in the parameters or the state dict)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim, self.theta = head_dim, theta
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._cache.get(device)
        if cached is None or cached[0].shape[0] < T:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
            inv_freq = 1.0 / (self.theta ** exponents)
            freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)
            angles = torch.cat((freqs, freqs), dim=-1)
            cached = (angles.cos(), angles.sin())
            if not torch.is_inference_mode_enabled():  # inference tensors cannot be saved for backward
                self._cache[device] = cached
        return cached[0][:T].to(dtype), cached[1][:T].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.hd = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.rotary = rotary
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        cos, sin = self.rotary(T, x.device, q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.n_kv != self.n_head:  # each key/value head serves n_head / n_kv query heads in a row
            k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.hd))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = LlamaAttention(cfg, rotary)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LlamaLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg, rotary) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # the norms' weights start at one
            residual = name.endswith("o_proj.weight") or name.endswith("down_proj.weight")
            # GPT-2's scaled init of residual projections keeps early activations bounded
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.cfg.context:
            raise ValueError(f"sequence of {T} tokens exceeds the model context {self.cfg.context}")
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        logits = self.lm_head(x) if self.lm_head is not None else x @ self.embed.weight.T  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
