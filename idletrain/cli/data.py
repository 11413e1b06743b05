"""`idletrain data prepare SOURCE --out DIR`: a corpus tokenized into shard files and a manifest
(shared/dataset.py), for `idletrain run create --data DIR`."""

from __future__ import annotations

import argparse
import json
import sys

from idletrain.cli.common import fail
from shared import sources
from shared.dataset import prepare
from worker.settings import parse_size


def record_bytes(text: str) -> int:
    """--max-record-bytes: a size (64MiB, 100MB, 1000000); argparse's error for anything else."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_prepare(args: argparse.Namespace) -> int:
    say = (lambda _: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        opts = sources.Options(text_field=args.text_field, errors=args.errors, skip_empty=args.skip_empty,
                               max_record_bytes=args.max_record_bytes)
        m = prepare(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                    shard_tokens=args.shard_tokens, eval_fraction=args.eval_fraction, eval_tokens=args.eval_tokens,
                    opts=opts, log=say)
    except ValueError as exc:  # SourceError included: it names the file and what to do
        return fail(str(exc))
    except KeyboardInterrupt:
        return fail(f"interrupted; nothing was kept in {args.out}")
    summary = {"out": str(args.out), "tokenizer": m.tokenizer.kind, "vocab_size": m.tokenizer.vocab_size,
               "dtype": m.dtype, "shards": len(m.shards), "train_tokens": m.train_tokens,
               "eval_tokens": m.eval.n_tokens, "bytes": m.train_bytes + m.eval.n_bytes}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"prepared {args.out}: {m.train_tokens:,} training tokens in {len(m.shards)} shards, "
              f"{m.eval.n_tokens:,} held out ({m.dtype}, {m.tokenizer.kind} tokenizer of {m.tokenizer.vocab_size:,} "
              f"tokens, {summary['bytes']:,} bytes of text)")
        print(f"next: idletrain run create NAME --data {args.out} --vocab-size {m.tokenizer.vocab_size}")
    return 0


def register(sub) -> None:
    """`idletrain data prepare ...`."""
    data = sub.add_parser("data", help="datasets: prepare a corpus into token shards")
    dsub = data.add_subparsers(dest="data_command", required=True)
    p = dsub.add_parser("prepare", help="tokenize a text file, folder, .jsonl or .parquet into shards + manifest",
                        description="Streams SOURCE (never whole in memory) into DIR/tokenizer.json, "
                                    "DIR/shards/*.bin, DIR/eval.bin and DIR/manifest.json.")
    p.add_argument("source", help="a text file, a folder (recursively), a .jsonl or a .parquet file")
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--tokenizer", default="bpe",
                   help="bytes (id = byte value, vocab 256) | bpe (trained here on SOURCE) | PATH to a "
                        "tokenizer.json (default: bpe)")
    p.add_argument("--vocab-size", type=int, default=8192, help="the BPE's vocab when --tokenizer bpe (default 8192)")
    p.add_argument("--text-field", default="text", help="the text field of .jsonl records / .parquet column")
    p.add_argument("--shard-tokens", type=int, default=1 << 24, help="tokens per shard file (default 16M)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--eval-fraction", type=float, default=0.01,
                       help="hold out this share of the tokens, spread through the corpus (default 0.01)")
    split.add_argument("--eval-tokens", type=int, default=None, help="hold out the first N tokens instead")
    p.add_argument("--errors", choices=["strict", "replace"], default="strict",
                   help="invalid UTF-8: strict stops with the file and offset; replace reads it as U+FFFD")
    p.add_argument("--skip-empty", action="store_true", help="skip empty files and records instead of stopping")
    p.add_argument("--max-record-bytes", type=record_bytes, default=sources.MAX_RECORD_BYTES, metavar="SIZE",
                   help="the largest .jsonl line or .parquet value, each read whole (memory takes about twice "
                        "it); a larger one stops with its line or row (default 64MiB)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_prepare)
