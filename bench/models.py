"""`python -m bench models`: bytes vs BPE, GPT vs Llama-style, on the same text, in bits per byte.

Four rows: bytes+GPT, bytes+Llama, BPE+GPT, BPE+Llama. Every row sees the same number of training
BYTES of text: the same steps, batch and lr schedule, and a context of the same span of text (the
BPE rows' context in tokens is the bytes rows' context over the train split's bytes per BPE
token). The BPE tokenizer is trained by shared.tokenizer.train_bpe on the train split only. The
GPT and the Llama-style model have about the same non-embedding parameters (the Llama's SwiGLU
width is matched to the GPT's 4x MLP). Training is single-process, shared.algorithms.inner.run_steps
with AdamW, warm-up and cosine decay: this measures the model and the tokenizer, not the protocol.

Each row runs a short lr sweep (PROFILES' lrs) and keeps the lr with the lowest loss on a
validation slice of the held-out files; what it reports is measured on a separate test slice of
them. Loss in bits per byte = nats per token x target tokens / target bytes / ln 2, the bytes being
the UTF-8 bytes the target tokens stand for (shared.tokenizer.token_byte_lengths): comparable
across tokenizers. Writes results.json, results.md and bpb.png (validation bits per byte against
training bytes seen) under --out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bench.numbers import sig
from shared.algorithms.inner import make_optimizer, run_steps, scheduled_lr
from shared.config import InnerConfig
from shared.data import BUILTIN, load_corpus
from shared.model import ModelConfig, build_model, count_params, evaluate_loss
from shared.tokenizer import Tokenizer, bytes_tokenizer, token_byte_lengths, train_bpe

log = logging.getLogger(__name__)

CHUNK_CHARS = 1 << 16  # texts are tokenized (and the BPE trained) in pieces of this many characters
SEGMENT_STEPS = 10  # the cosine schedule's lr is updated every this many steps


@dataclasses.dataclass(frozen=True)
class Profile:
    d_model: int
    n_layer: int
    n_head: int
    context_bytes: int  # the bytes rows' context; the BPE rows' is the same span of text in tokens
    batch_size: int
    steps: int
    lrs: tuple[float, ...]  # the sweep: every row trains at each, keeps the best on the validation slice
    warmup_steps: int
    vocab_size: int  # the BPE rows' vocabulary
    corpus_max_bytes: int
    val_bytes: int  # held-out bytes that pick the lr and draw the curve
    test_bytes: int  # held-out bytes (after the validation slice) the table reports
    eval_every: int  # steps between points of the curve


PROFILES = {
    # 4 rows x 3 lrs of the 0.6M-parameter demo shape, 409,600 bytes each: 23 min measured on 2 cores with
    # another job on one of them (docs/BENCHMARKS.md), about 10 on 2 idle ones
    "quick": Profile(d_model=128, n_layer=3, n_head=4, context_bytes=128, batch_size=16, steps=200,
                     lrs=(2e-3, 4e-3, 8e-3), warmup_steps=20, vocab_size=4096, corpus_max_bytes=4 << 20,
                     val_bytes=32 << 10, test_bytes=96 << 10, eval_every=50),
    # an hour or more on 2 cores (not committed): 5x the steps, an 8192-token BPE, a 16 MiB corpus
    "full": Profile(d_model=128, n_layer=3, n_head=4, context_bytes=128, batch_size=16, steps=1500,
                    lrs=(1.5e-3, 3e-3, 6e-3), warmup_steps=100, vocab_size=8192, corpus_max_bytes=16 << 20,
                    val_bytes=64 << 10, test_bytes=256 << 10, eval_every=150),
}


@dataclasses.dataclass
class EvalSet:
    """Held-out token ids and what evaluate_loss's windows score of them: target tokens and bytes."""

    ids: torch.Tensor
    context: int
    target_tokens: int
    target_bytes: int


def eval_set(ids: Sequence[int] | np.ndarray, byte_lengths: np.ndarray, context: int) -> EvalSet:
    """evaluate_loss(tokens, context) scores n = (len - 1) // context windows whose targets are
    ids[1 : n * context + 1]: count them and the bytes they stand for."""
    arr = np.asarray(ids, dtype=np.int64)
    n_seq = (arr.size - 1) // context
    if n_seq < 1:
        raise ValueError(f"{arr.size} held-out tokens are fewer than one window of {context}: raise the "
                         "profile's val_bytes/test_bytes")
    targets = arr[1:n_seq * context + 1]
    return EvalSet(torch.from_numpy(arr), context, int(targets.size), int(byte_lengths[targets].sum()))


def bits_per_byte(nats_per_token: float, target_tokens: int, target_bytes: int) -> float:
    """Mean loss in nats per token over `target_tokens` tokens that stand for `target_bytes` bytes,
    as bits per byte (the same number whatever the tokenizer)."""
    return nats_per_token * target_tokens / target_bytes / math.log(2)


def evaluate_bpb(model: torch.nn.Module, es: EvalSet) -> tuple[float, float]:
    """(nats per token, bits per byte) of the model on the eval set."""
    nats = evaluate_loss(model, es.ids, context=es.context)
    return nats, bits_per_byte(nats, es.target_tokens, es.target_bytes)


def _cut(text: str, n_bytes: int, start: int = 0) -> tuple[str, int]:
    """The text from character `start` up to about n_bytes UTF-8 bytes, ending after a newline; and
    where it ends."""
    end = start
    size = 0
    while end < len(text) and size < n_bytes:
        nl = text.find("\n", end, end + 4096)
        nxt = nl + 1 if nl >= 0 else min(len(text), end + 4096)
        size += len(text[end:nxt].encode())
        end = nxt
    return text[start:end], end


def _chunks(text: str) -> list[str]:
    return [text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]


def encode(tok: Tokenizer, text: str) -> np.ndarray:
    if tok.kind == "bytes":
        return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)
    return np.fromiter((i for ids in tok.encode_batch(_chunks(text)) for i in ids), dtype=np.int64)


@dataclasses.dataclass
class Texts:
    train: str
    val: str
    test: str


def load_texts(p: Profile, source: str = BUILTIN) -> Texts:
    """The corpus's train split and two disjoint slices of its held-out files, as text (bytes that are
    not UTF-8 become U+FFFD, for every row alike)."""
    corpus = load_corpus(source, max_bytes=p.corpus_max_bytes)
    held_out = corpus.eval.tobytes().decode("utf-8", "replace")
    val, end = _cut(held_out, p.val_bytes)
    test, _ = _cut(held_out, p.test_bytes, start=end)
    if not test:
        raise ValueError(f"the held-out split ({corpus.eval.size:,} bytes) has nothing after the validation slice: "
                         "lower the profile's val_bytes or raise corpus_max_bytes")
    return Texts(train=corpus.train.tobytes().decode("utf-8", "replace"), val=val, test=test)


def matched_ffn(d_model: int) -> int:
    """The Llama's SwiGLU width whose block holds about the GPT block's parameters: 4d^2 + 3d f + 2d
    = 12d^2 + 13d gives f ~ (8d + 11) / 3, rounded to a multiple of 8."""
    return 8 * round((8 * d_model + 11) / 3 / 8)


def model_config(p: Profile, arch: str, vocab_size: int, context: int) -> ModelConfig:
    extra = {"ffn_hidden": matched_ffn(p.d_model)} if arch == "llama" else {}
    return ModelConfig(arch=arch, vocab_size=vocab_size, n_layer=p.n_layer, n_head=p.n_head, d_model=p.d_model,
                       context=context, **extra)


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters outside the token (and learned position) embeddings and an untied output head."""
    skip = ("wte.", "wpe.", "embed.", "lm_head.")
    return sum(q.numel() for n, q in model.named_parameters() if not n.startswith(skip))


@dataclasses.dataclass
class Arm:
    """One row: a tokenizer and a model over it, and the data in its tokens."""

    name: str
    tokenizer: str  # "bytes" or "bpe"
    cfg: ModelConfig
    train: torch.Tensor
    val: EvalSet
    test: EvalSet
    bytes_per_token: float  # of the train split


def train_one(arm: Arm, p: Profile, lr: float, *, seed: int = 0) -> dict:
    """Train the arm's model at peak lr `lr`; its curve on the validation slice and its final losses."""
    inner = InnerConfig(batch_size=p.batch_size, lr=lr, warmup_steps=p.warmup_steps)
    model = build_model(arm.cfg, seed=seed)
    opt = make_optimizer(model, inner)
    gen = torch.Generator().manual_seed(seed + 1)  # the same batches for every lr of a row
    bytes_per_step = p.batch_size * arm.cfg.context * arm.bytes_per_token
    curve, t0, done = [], time.perf_counter(), 0
    while done < p.steps:
        n = min(SEGMENT_STEPS, p.steps - done, p.eval_every - done % p.eval_every)
        step_lr = scheduled_lr(inner, tokens_done=done, schedule_tokens=p.steps)  # steps: same tokens each
        run_steps(model, opt, arm.train, inner, lr=step_lr, steps=n, generator=gen, step_offset=done)
        done += n
        if done % p.eval_every == 0 or done == p.steps:
            curve.append([int(done * bytes_per_step), sig(evaluate_bpb(model, arm.val)[1])])
    wall = time.perf_counter() - t0
    test_nats, test_bpb = evaluate_bpb(model, arm.test)
    return {"lr": lr, "val_bpb": curve[-1][1], "test_bpb": sig(test_bpb), "test_nats_per_token": sig(test_nats),
            "train_wall_s": round(wall, 1), "curve": curve}


def build_arms(p: Profile, texts: Texts, rows: Sequence[str] | None = None) -> tuple[list[Arm], dict]:
    """The four rows (or those named in `rows`), the BPE trained on the train split."""
    t0 = time.perf_counter()
    bpe = train_bpe(iter(_chunks(texts.train)), p.vocab_size)
    info = {"bpe_vocab_size": bpe.vocab_size, "bpe_train_s": round(time.perf_counter() - t0, 1)}
    arms = []
    for kind, tok in (("bytes", bytes_tokenizer()), ("bpe", bpe)):
        lengths = token_byte_lengths(tok)
        train = encode(tok, texts.train)
        val, test = encode(tok, texts.val), encode(tok, texts.test)
        bpt = len(texts.train.encode()) / train.size
        # BPE tokens stand for every byte: a tokenizer that lost or invented one would skew the bits per byte
        if int(lengths[val].sum()) != len(texts.val.encode()):
            raise ValueError(f"the {kind} tokenizer's token bytes do not add up to the text's: bits per byte "
                             "would be wrong")
        context = p.context_bytes if kind == "bytes" else max(8, round(p.context_bytes / bpt))
        info[f"{kind}_bytes_per_token"] = round(bpt, 4)
        info[f"{kind}_context"] = context
        for arch in ("gpt", "llama"):
            name = f"{kind} + {'GPT' if arch == 'gpt' else 'Llama'}"
            if rows and not any(r in name for r in rows):
                continue
            cfg = model_config(p, arch, tok.vocab_size, context)
            arms.append(Arm(name, kind, cfg, torch.from_numpy(train), eval_set(val, lengths, context),
                            eval_set(test, lengths, context), bpt))
    return arms, info


def run_arm(arm: Arm, p: Profile) -> dict:
    model = build_model(arm.cfg)
    sweep = []
    for lr in p.lrs:
        r = train_one(arm, p, lr)
        log.info("%s lr %g: val %.4f, test %.4f bits/byte, %.0f s", arm.name, lr, r["val_bpb"], r["test_bpb"],
                 r["train_wall_s"])
        sweep.append(r)
    best = min(sweep, key=lambda r: r["val_bpb"])
    return {"row": arm.name, "tokenizer": arm.tokenizer, "arch": arm.cfg.arch, "model": arm.cfg.to_dict(),
            "params": count_params(model), "non_embedding_params": non_embedding_params(model),
            "context_tokens": arm.cfg.context, "bytes_per_token": round(arm.bytes_per_token, 4),
            "train_bytes_seen": int(p.steps * p.batch_size * arm.cfg.context * arm.bytes_per_token),
            "test_tokens": arm.test.target_tokens, "test_bytes": arm.test.target_bytes,
            **{k: best[k] for k in ("lr", "test_bpb", "test_nats_per_token", "val_bpb", "train_wall_s", "curve")},
            "lr_sweep": [{k: r[k] for k in ("lr", "val_bpb", "test_bpb", "train_wall_s")} for r in sweep],
            "lr_at_sweep_edge": best["lr"] in (min(p.lrs), max(p.lrs)) and len(p.lrs) > 1}


def write_markdown(result: dict, path: Path) -> None:
    m = result["meta"]
    lines = [f"# Models and tokenizers, profile `{m['profile']}`", "",
             f"{m['train_bytes_seen']:,} training bytes of text per row ({m['steps']} steps x {m['batch_size']} "
             f"sequences of {m['context_bytes']} bytes; the BPE rows' {m['bpe_context']}-token context spans "
             f"{m['bpe_context'] * m['bpe_bytes_per_token']:.0f} bytes on average, {m['bpe_bytes_per_token']:.2f} "
             f"bytes per token). BPE: {m['bpe_vocab_size']:,} tokens, trained on the train split. Held-out "
             f"test slice: {m['test_bytes']:,} bytes of files never trained on; lr picked per row on a separate "
             f"{m['val_bytes']:,}-byte validation slice. {m['torch_threads']} torch threads, {m['total_wall_s']:.0f} s.",
             "", "| row | test bits/byte | nats/token | params | non-embedding | best lr (val bits/byte per lr) "
             "| wall s |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        sweep = ", ".join(f"{s['lr']:g}: {s['val_bpb']:.3f}" for s in r["lr_sweep"])
        edge = " (edge)" if r["lr_at_sweep_edge"] else ""
        lines.append(f"| {r['row']} | {r['test_bpb']:.3f} | {r['test_nats_per_token']:.3f} | {r['params']:,} | "
                     f"{r['non_embedding_params']:,} | {r['lr']:g}{edge} ({sweep}) | {r['train_wall_s']:.0f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        x, y = zip(*r["curve"])
        ax.plot([b / 1e6 for b in x], y, marker="o", markersize=3, label=f"{r['row']} (lr {r['lr']:g})")
    ax.set_xlabel("training bytes seen (millions)")
    ax.set_ylabel("held-out loss (bits per byte, validation slice)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(*, profile: str | Profile = "quick", out: Path = Path("bench-results/models"), threads: int | None = None,
        rows: Sequence[str] | None = None, source: str = BUILTIN) -> dict:
    """Every row, its sweep; writes results.json, results.md and bpb.png under `out`."""
    p = PROFILES[profile] if isinstance(profile, str) else profile
    name = profile if isinstance(profile, str) else "custom"
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    texts = load_texts(p, source)
    arms, info = build_arms(p, texts, rows)
    log.info("corpus read, BPE trained (%s), texts tokenized: %.0f s; %d rows x %d lrs to train", info,
             time.perf_counter() - t0, len(arms), len(p.lrs))
    results = [run_arm(arm, p) for arm in arms]
    meta = {"profile": name, **dataclasses.asdict(p), "torch_threads": torch.get_num_threads(), **info,
            "train_bytes_seen": p.steps * p.batch_size * p.context_bytes, "val_bytes": len(texts.val.encode()),
            "test_bytes": len(texts.test.encode()), "total_wall_s": round(time.perf_counter() - t0, 1)}
    result = {"meta": meta, "rows": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result, out / "results.md")
    plot(results, out / "bpb.png", title=f"python -m bench models --profile {name}")
    return result
