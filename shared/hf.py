"""A model as a Hugging Face folder: config.json, model.safetensors with transformers' tensor names,
and the tokenizer files, which `transformers.AutoModelForCausalLM` and `AutoTokenizer` load. Writing
the folder needs neither (`idletrain export --format hf` and a finished run's final export write it).

    arch "llama" -> LlamaForCausalLM: shared/llama.py computes what it computes, names only differ.
    arch "gpt"   -> GPT2LMHeadModel with activation_function "gelu" (our GELU is exact, not GPT-2's
                    tanh "gelu_new"); its Conv1D layers hold the transposes of our Linear weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from shared.files import readable
from shared.model import ModelConfig
from shared.tokenizer import EOT, Tokenizer

MODEL_FILE = "model.safetensors"


def _special_ids(tok: Tokenizer) -> dict:
    eot = tok.eot_id
    return {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": None}


def hf_config(cfg: ModelConfig, tok: Tokenizer) -> dict:
    """config.json of the transformers model that computes what `cfg`'s model computes."""
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32",
              "use_cache": True, "initializer_range": 0.02, **_special_ids(tok)}
    if cfg.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layer,
                "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                "hidden_act": "silu", "max_position_embeddings": cfg.context, "rms_norm_eps": cfg.norm_eps,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.dropout}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
            "n_positions": cfg.context, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_inner": cfg.ffn_dim, "activation_function": "gelu", "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": cfg.dropout, "scale_attn_weights": True}


def _llama_name(name: str) -> str:
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "lm_head.weight":
        return name
    _, i, rest = name.split(".", 2)  # blocks.{i}.…
    rest = rest.replace("attn_norm.", "input_layernorm.").replace("mlp_norm.", "post_attention_layernorm.")
    return f"model.layers.{i}.{rest.replace('attn.', 'self_attn.', 1)}"


GPT_PARTS = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
             "mlp.0": "mlp.c_fc", "mlp.2": "mlp.c_proj"}


def _gpt_name(name: str) -> tuple[str, bool]:
    """(transformers' name, whether the tensor is a Conv1D weight: stored transposed)."""
    if not name.startswith("blocks."):
        return f"transformer.{name}", False
    _, i, rest = name.split(".", 2)
    part, leaf = rest.rsplit(".", 1)
    return f"transformer.h.{i}.{GPT_PARTS[part]}.{leaf}", leaf == "weight" and not part.startswith("ln")


def hf_tensors(cfg: ModelConfig, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameters under transformers' names and layouts (a tied head is not stored: transformers
    ties it on load)."""
    out = {}
    for name, t in params.items():
        if cfg.arch == "llama":
            out[_llama_name(name)] = t.contiguous()
        else:
            hf_name, transpose = _gpt_name(name)
            out[hf_name] = t.t().contiguous() if transpose else t.contiguous()
    return out


def tokenizer_files(tok: Tokenizer, *, context: int) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for AutoTokenizer."""
    special = {"bos_token": EOT, "eos_token": EOT} if tok.eot_id is not None else {}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context,
              "clean_up_tokenization_spaces": False, "add_prefix_space": False, **special}
    return {"tokenizer.json": tok.to_json(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}


def write_hf_folder(out: Path, cfg: ModelConfig, params: Mapping[str, torch.Tensor], tok: Tokenizer,
                    provenance: Mapping[str, str]) -> None:
    """The folder transformers loads. ValueError (saying what to do) when it cannot be written."""
    import safetensors.torch

    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"the run's tokenizer has {tok.vocab_size:,} tokens but its model only {cfg.vocab_size:,}: "
                         "this run's tokenizer is not the model's")
    if out.suffix == ".safetensors" or out.is_file():
        raise ValueError(f"--format hf writes a folder; {str(out)!r} is a file name (give a folder, e.g. "
                         f"{out.with_suffix('')}), or use --format safetensors")
    out.mkdir(parents=True, exist_ok=True)
    files = {"config.json": json.dumps(hf_config(cfg, tok), indent=2) + "\n",
             **tokenizer_files(tok, context=cfg.context)}
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    metadata = {"format": "pt", **provenance}
    safetensors.torch.save_file(hf_tensors(cfg, params), str(out / MODEL_FILE), metadata=dict(metadata))
    readable(out / MODEL_FILE)  # save_file makes it 0600, unlike the folder's other files
