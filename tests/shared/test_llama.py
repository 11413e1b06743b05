"""shared/llama.py: the Llama-style decoder against transformers' LlamaForCausalLM with the same
weights, its exact parameter count, and ModelConfig's arch fields and presets (shared/model.py)."""

from __future__ import annotations

import os

import pytest
import torch

from shared.config import RunConfig
from shared.model import (
    PRESETS,
    ModelConfig,
    build_model,
    count_params,
    generate_ids,
    get_params,
    meta_schema,
    param_schema,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads: every config below is built here

LLAMA = dict(arch="llama", vocab_size=97, n_layer=2, n_head=4, d_model=64, context=24)


def _hf_llama(cfg: ModelConfig, params: dict[str, torch.Tensor]):
    """transformers' LlamaForCausalLM configured by hand and loaded with our weights under its names
    (written out here, not taken from idletrain/export.py: an independent reference)."""
    transformers = pytest.importorskip("transformers", reason="pip install 'idletrain[test]' (transformers)")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.context, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attention_bias=False, mlp_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = {"model.embed_tokens.weight": params["embed.weight"], "model.norm.weight": params["norm.weight"]}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = params["lm_head.weight"]
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        state[theirs + "input_layernorm.weight"] = params[ours + "attn_norm.weight"]
        state[theirs + "post_attention_layernorm.weight"] = params[ours + "mlp_norm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"{theirs}self_attn.{proj}.weight"] = params[f"{ours}attn.{proj}.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            state[f"{theirs}mlp.{proj}.weight"] = params[f"{ours}mlp.{proj}.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head is the embedding
    return hf


def _perturbed(cfg: ModelConfig, seed: int):
    """A model whose norm weights are not all one (so a mis-mapped norm shows in the logits)."""
    model = build_model(cfg, seed=seed).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.2)
    return model


@pytest.mark.parametrize("extra", [
    {},  # multi-head attention, tied head
    {"n_kv_head": 2, "tie_embeddings": False},  # grouped-query attention, untied head
    {"n_kv_head": 1, "ffn_hidden": 100, "rope_theta": 500.0, "norm_eps": 1e-6},  # multi-query, odd widths
])
def test_logits_equal_transformers_llama_with_the_same_weights(extra):
    cfg = ModelConfig(**LLAMA, **extra)
    model = _perturbed(cfg, seed=3)
    hf = _hf_llama(cfg, get_params(model))
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(input_ids=idx).logits
    assert ours.shape == theirs.shape == (3, cfg.context, cfg.vocab_size)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # a shorter sequence too: the rotary angles are per position, not per length
    with torch.no_grad():
        torch.testing.assert_close(model(idx[:, :7])[0], hf(input_ids=idx[:, :7]).logits, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_transformers():
    cfg = ModelConfig(**LLAMA, n_kv_head=2)
    model = _perturbed(cfg, seed=5)
    hf = _hf_llama(cfg, get_params(model))
    prompt = [5, 17, 42]
    ours = generate_ids(model, prompt, max_new_tokens=12, temperature=0)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert ours == theirs[0, len(prompt):].tolist()


@pytest.mark.parametrize("cfg", [
    ModelConfig(**LLAMA),
    ModelConfig(**LLAMA, n_kv_head=1, tie_embeddings=False),
    ModelConfig(**LLAMA, ffn_hidden=72, n_kv_head=2),
    ModelConfig.preset("llama-tiny"),
    ModelConfig.preset("small", n_layer=1),
    ModelConfig.preset("llama-60m", n_layer=1, vocab_size=1000),
])
def test_n_params_is_exact_and_the_meta_schema_is_the_built_schema(cfg):
    model = build_model(cfg)
    assert cfg.n_params() == count_params(model)
    assert meta_schema(cfg) == param_schema(model)
    assert list(model.blocks) and all(type(b).__name__ == "LlamaBlock" for b in model.blocks)  # checkpointable
    assert ("lm_head.weight" in param_schema(model)) is (not cfg.tie_embeddings)
    assert not any(name.endswith(".bias") for name in param_schema(model))


def test_the_default_ffn_width_is_eight_thirds_rounded_up_to_64():
    assert ModelConfig(**LLAMA).ffn_dim == 192  # 8/3 * 64 = 170.7
    assert ModelConfig(**{**LLAMA, "d_model": 384, "n_head": 6}).ffn_dim == 1024
    assert ModelConfig().ffn_dim == 512  # gpt: 4 d


def test_build_is_deterministic_by_seed_and_leaves_the_global_rng_alone():
    cfg = ModelConfig(**LLAMA)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = (get_params(build_model(cfg, seed=s)) for s in (1, 1, 2))
    assert torch.equal(torch.rand(1), before)
    assert all(torch.equal(a[n], b[n]) for n in a) and not torch.equal(a["embed.weight"], c["embed.weight"])


def test_causal_and_a_few_steps_lower_the_loss():
    cfg = ModelConfig(**LLAMA, n_kv_head=2)
    model = build_model(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.context), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % cfg.vocab_size
    with torch.no_grad():
        assert torch.equal(model(idx)[0][:, :10], model(changed)[0][:, :10])  # no position sees a later one
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.7


def test_bf16_autocast_runs_and_keeps_fp32_weights():
    cfg = ModelConfig(**LLAMA)
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
                                        for p in model.parameters())


def test_vocab_above_65536_builds():
    cfg = ModelConfig(arch="llama", vocab_size=70_000, n_layer=1, n_head=2, d_model=8, context=8)
    model = build_model(cfg)
    logits, _ = model(torch.tensor([[69_999, 0, 65_536]]))
    assert logits.shape == (1, 3, 70_000) and cfg.n_params() == count_params(model)


@pytest.mark.parametrize("kwargs,match", [
    ({"arch": "bert"}, "arch must be one of gpt, llama"),
    ({"n_kv_head": 4}, "applies to arch 'llama' only"),
    ({"tie_embeddings": False}, "applies to arch 'llama' only"),
    ({"ffn_hidden": 256}, "applies to arch 'llama' only"),
    ({"rope_theta": 5e5}, "applies to arch 'llama' only"),
    ({**LLAMA, "n_kv_head": 3}, r"n_head \(4\) must be a multiple of n_kv_head \(3\)"),
    ({**LLAMA, "n_kv_head": 0}, "n_kv_head must be a positive integer"),
    ({**LLAMA, "d_model": 60, "n_head": 4}, "even head size"),
    ({**LLAMA, "rope_theta": 0.5}, "rope_theta must be"),
    ({**LLAMA, "tie_embeddings": "yes"}, "tie_embeddings must be true or false"),
    ({**LLAMA, "norm_eps": 0.0}, "norm_eps must be in"),
    ({**LLAMA, "rope_theta": "big"}, "rope_theta must be a number"),
])
def test_arch_fields_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_presets_resolve_and_their_fields_can_be_overridden():
    assert ModelConfig.preset("tiny") == ModelConfig()  # the demo's model
    small = ModelConfig.from_dict({"preset": "small"})
    assert small.arch == "llama" and 19e6 < small.n_params() < 22e6
    assert ModelConfig.preset("gpt2-124m").n_params() == 124_439_808  # GPT-2 small's count
    assert ModelConfig.preset("llama-60m").n_params() == 58_073_600
    assert ModelConfig.from_dict({"preset": "small", "context": 128, "vocab_size": 300}) == \
        ModelConfig(**{**PRESETS["small"], "context": 128, "vocab_size": 300})
    with pytest.raises(ValueError, match="unknown model preset 'huge': choose one of tiny, llama-tiny, small"):
        ModelConfig.from_dict({"preset": "huge"})
    # in a run config, as `model = {preset = "small"}` in TOML would give it; stored resolved
    run = RunConfig.model_validate({"name": "r", "model": {"preset": "small", "rope_theta": 500000}})
    assert run.model.rope_theta == 500000.0 and isinstance(run.model.rope_theta, float)
    again = RunConfig.model_validate_json(run.model_dump_json())
    assert again.model == run.model and "preset" not in again.model.to_dict()
