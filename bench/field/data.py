"""The field's tokens: the shards and held-out split a run gets from the coordinator (the same functions,
`shared.data.load_corpus` and `cut_shards`, with the run's corpus, size, shard length and seed), so the
data-parallel rows train on what the idletrain workers train on.

The held-out split is cut in two, disjoint: its first `eval_tokens` are what the coordinator evaluates a
run on (the *test* slice: every reported number), the next `eval_tokens` the *validation* slice (every
choice: the baselines' learning rates).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shared.data import cut_shards, load_corpus


def data_spec(run: dict) -> dict:
    """What `field_tokens` needs of a run's config (a dict as POST /runs takes it)."""
    return {"corpus": run["corpus"], "corpus_max_bytes": run["corpus_max_bytes"], "shard_tokens": run["shard_tokens"],
            "seed": run.get("seed", 0), "eval_tokens": run["eval_tokens"]}


def field_tokens(spec: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the run's shards in the order it leases them, its whole held-out split)."""
    corpus = load_corpus(spec["corpus"], max_bytes=spec["corpus_max_bytes"])
    shards = cut_shards(corpus.train, spec["shard_tokens"], shuffle_seed=spec["seed"])
    return [torch.from_numpy(s.copy()) for s in shards], torch.from_numpy(corpus.eval.copy())


def slices(held: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """{"test": the coordinator's eval tokens (the first `n` of the held-out split), "validation": the
    next `n`}; ValueError when the held-out split is too short for both."""
    if held.numel() < 2 * n:
        raise ValueError(f"the held-out split has {held.numel()} tokens, fewer than 2 x eval_tokens = {2 * n}")
    return {"test": held[:n], "validation": held[n:2 * n]}


def stage_shards(shards: list[torch.Tensor], path: Path) -> Path:
    """The run's shards in one .npy (lease order, equal lengths), for the data-parallel ranks to map."""
    np.save(path, np.stack([s.numpy() for s in shards]))
    return path


def staged_shards(path: str | Path) -> list[torch.Tensor]:
    return [torch.from_numpy(np.array(row)) for row in np.load(path, mmap_mode="r")]
