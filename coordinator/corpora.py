"""Where a run's corpus may come from (pure: paths only, no reading).

A run's corpus is read on the coordinator's machine and handed to every worker as shards, so a
corpus path is a way to publish any file the coordinator can read. Only the built-in corpus and
paths inside the allowed folders (CoordinatorSettings.allowed_corpus_dirs) are accepted; the path
is resolved first (symlinks, `..`), so neither leads out of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from coordinator.errors import Unprocessable
from shared.data import BUILTIN


def confine(source: str, allowed: Sequence[Path], *, what: str = "corpus") -> str:
    """The corpus to load: BUILTIN as is, else `source` resolved, when inside one of `allowed`
    (resolved folders); anything else is refused with 422 naming them and how to add one. `what`
    names it in those messages ("corpus", or "data" for a prepared folder)."""
    if source == BUILTIN and what == "corpus":
        return source
    try:
        path = Path(source).expanduser().resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop, an unreadable path component
        raise Unprocessable(f"{what} {source!r} cannot be resolved ({exc})") from None
    if any(path.is_relative_to(root) for root in allowed):
        return str(path)
    folders = ", ".join(str(root) for root in allowed)
    raise Unprocessable(f"{what} {source!r} is outside the folders corpora may come from ({folders}): move it into "
                        f"one, or start the coordinator with IDLETRAIN_CORPUS_DIRS (or `serve --corpus-dir`) naming "
                        f"its folder; {BUILTIN!r} is always allowed")
