"""A run's model, fetched from a running coordinator and checked like a worker checks it:
`idletrain export` (.safetensors, or a Hugging Face folder: idletrain/export.py) and `idletrain sample`
(text, through the run's tokenizer)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from idletrain.cli.client import OperatorClient
from idletrain.cli.common import DEFAULT_COORDINATOR, fail
from shared.files import readable

def _fetch_model(args: argparse.Namespace, version: str):
    """(params, metadata, ModelConfig) of a run's snapshot, checked like a worker checks it."""
    import hashlib

    from shared.model import ModelConfig, build_model, param_schema
    from shared.snapshot import decode_snapshot

    client = OperatorClient(args)
    rc, cfg = client.call("GET", f"/runs/{args.run}/config")
    if rc:
        return rc, None
    rc, resp = client.snapshot(args.run, version)
    if rc:
        return rc, None
    if hashlib.sha256(resp.content).hexdigest() != resp.headers.get("x-content-sha256"):
        return fail("the snapshot does not match its X-Content-SHA256 header; try again"), None
    model_cfg = ModelConfig.from_dict(cfg["model"])
    params, meta = decode_snapshot(resp.content, schema=param_schema(build_model(model_cfg)))
    return 0, (params, {**meta, "version": resp.headers.get("x-model-version", meta.get("version", "?"))}, model_cfg)


def cmd_export(args: argparse.Namespace) -> int:
    import safetensors.torch

    from idletrain import export
    from shared.snapshot import snapshot_metadata

    out = Path(args.out)
    if args.format == "safetensors" and out.suffix != ".safetensors":
        return fail(f"write the model to a .safetensors file, not {out.name!r} (or a folder with --format hf)")
    rc, got = _fetch_model(args, args.version)
    if rc:
        return rc
    params, meta, model_cfg = got
    metadata = snapshot_metadata(args.run, int(meta["version"]), model_cfg.to_dict())
    n = sum(t.numel() for t in params.values())
    if args.format == "hf":
        try:
            tok = export.fetch_tokenizer(args.coordinator, args.run)
            export.write_hf_folder(out, model_cfg, params, tok, metadata)
        except (ValueError, OSError) as exc:
            return fail(f"cannot export to {out}: {exc}")
        print(f"wrote {out}/: run {args.run} version {meta['version']}, {n:,} parameters, a Hugging Face "
              f"{export.hf_config(model_cfg, tok)['architectures'][0]} with its {tok.kind} tokenizer "
              f"({tok.vocab_size:,} tokens); load it with transformers.AutoModelForCausalLM.from_pretrained")
        return 0
    metadata["format"] = "idletrain model; shared.model.build_model(ModelConfig.from_dict(model))"
    out.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({n: t.contiguous() for n, t in params.items()}, str(out), metadata=metadata)
    readable(out)  # save_file makes it 0600
    print(f"wrote {out}: run {args.run} version {meta['version']}, {n:,} parameters")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from idletrain.export import fetch_tokenizer
    from shared.model import build_model, generate_ids, set_params

    if args.tokens < 1 or args.tokens > 100_000:
        return fail("--tokens must be between 1 and 100000")
    if args.temperature < 0:
        return fail("--temperature must be 0 (greedy) or more")
    rc, got = _fetch_model(args, args.version)
    if rc:
        return rc
    params, meta, model_cfg = got
    try:
        tok = fetch_tokenizer(args.coordinator, args.run)
    except ValueError as exc:
        return fail(str(exc))
    model = build_model(model_cfg)
    set_params(model, params)
    # an empty prompt starts from the document separator (a BPE's), or a newline (bytes)
    prompt = tok.encode(args.prompt) or ([tok.eot_id] if tok.eot_id is not None else tok.encode("\n"))
    ids = generate_ids(model, prompt, max_new_tokens=args.tokens, temperature=args.temperature,
                       top_k=args.top_k or None, generator=torch.Generator().manual_seed(args.seed),
                       allowed=min(tok.vocab_size, model_cfg.vocab_size))  # only ids the tokenizer decodes
    print(f"# run {args.run}, version {meta['version']}, {tok.kind} tokenizer", file=sys.stderr)
    sys.stdout.write(args.prompt + tok.decode(ids) + "\n")
    return 0


def register(sub) -> None:
    """`idletrain export`, `idletrain sample`."""
    exp = sub.add_parser("export", help="save a run's model: a .safetensors file, or a Hugging Face folder")
    exp.add_argument("out", metavar="OUT", help="OUT.safetensors, or a folder with --format hf")
    exp.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                     help="safetensors: our tensors and config (default); hf: a folder transformers loads "
                          "(config.json, model.safetensors, the run's tokenizer)")
    smp = sub.add_parser("sample", help="generate text from a run's current model")
    smp.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    smp.add_argument("--tokens", type=int, default=300, help="tokens to generate (default 300)")
    smp.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    smp.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0 = all")
    smp.add_argument("--seed", type=int, default=0)
    for sp, func in ((exp, cmd_export), (smp, cmd_sample)):
        sp.add_argument("--run", required=True)
        sp.add_argument("--version", default="latest", help="a version number or 'latest' (default)")
        sp.add_argument("--coordinator", default=DEFAULT_COORDINATOR)
        sp.set_defaults(func=func)
