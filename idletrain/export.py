"""A run's model as a Hugging Face folder (`idletrain export --format hf`): config.json,
model.safetensors with transformers' tensor names, and the run's tokenizer files, which
`transformers.AutoModelForCausalLM` and `AutoTokenizer` load (`pip install 'idletrain[hf]'` to use
them; writing the folder needs neither). The folder's writing lives in shared/hf.py (the coordinator
writes a finished run's final export with it); this module fetches the run's tokenizer.

    arch "llama" -> LlamaForCausalLM: shared/llama.py computes what it computes, names only differ.
    arch "gpt"   -> GPT2LMHeadModel with activation_function "gelu" (our GELU is exact, not GPT-2's
                    tanh "gelu_new"); its Conv1D layers hold the transposes of our Linear weights.

tests/test_cli_export.py loads exported folders in transformers and compares the logits with ours.
"""

from __future__ import annotations

import httpx

from shared.hf import MODEL_FILE, hf_config, hf_tensors, tokenizer_files, write_hf_folder
from shared.tokenizer import Tokenizer, bytes_tokenizer

__all__ = ["MODEL_FILE", "fetch_tokenizer", "hf_config", "hf_tensors", "tokenizer_files", "write_hf_folder"]


def fetch_tokenizer(base: str, run: str) -> Tokenizer:
    """The run's tokenizer from its coordinator (GET /runs/{run}/tokenizer); the bytes tokenizer from
    a coordinator that has no such route (404: it predates tokenizers, so its runs are byte-level).
    ValueError for anything else."""
    try:
        resp = httpx.get(f"{base}/api/v1/runs/{run}/tokenizer", timeout=60)
    except httpx.TransportError as exc:
        raise ValueError(f"cannot reach the coordinator at {base} ({exc}); is it running?") from None
    if resp.status_code == 404 and resp.text.replace(" ", "") == '{"detail":"NotFound"}':  # no such route
        return bytes_tokenizer()
    if resp.status_code != 200:
        raise ValueError(f"the run's tokenizer: {resp.status_code}: {resp.text[:200]}")
    tok = Tokenizer.from_json(resp.text, source=f"run {run!r}'s tokenizer")
    etag = resp.headers.get("etag", "").removeprefix("W/").strip('"')
    if etag and etag != tok.sha256:
        raise ValueError(f"run {run!r}'s tokenizer does not match its ETag (sha256 {etag}); try again")
    return tok
