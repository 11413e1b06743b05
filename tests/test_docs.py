"""The documents: every relative link in README.md and docs/*.md leads to a file (and heading) in the
repository, and README's test command is the one CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def links(doc: Path) -> list[str]:
    text = FENCE.sub("", doc.read_text())
    return [m[1] for m in LINK.finditer(re.sub(r"`[^`\n]*`", "", text))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """The heading anchors of a document; a repeated heading's get -1, -2, … as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for m in re.finditer(r"^#+ (.+)$", FENCE.sub("", doc.read_text()), re.M):
        base = slug(m[1])
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or REPO not in (dest, *dest.parents):
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{doc.relative_to(REPO)} links to what is not in the repository: {broken}"


def test_readme_test_command_is_what_ci_runs():
    readme = FENCE.findall((REPO / "README.md").read_text())
    quick_start = [block.splitlines()[1] for block in readme[:2]]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert quick_start[1] == ci[-1], "README's test command is not the last command of .ci/run"
    assert quick_start[1].endswith("-m pytest") and "demo" in quick_start[0]


def test_slug_matches_github():
    assert slug("Goal, and what bounds it") == "goal-and-what-bounds-it"
    assert slug("Worker (volunteers)") == "worker-volunteers"


def test_real_models_table_gives_each_presets_parameters_by_vocab():
    """docs/real-models.md's table of parameters by preset and vocab is the code's count (issue 36:
    the docs said 672,640 for llama-tiny, which --vocab-size 8192 makes 1,688,448)."""
    import re

    from shared.model import PRESETS, ModelConfig

    text = (REPO / "docs" / "real-models.md").read_text()
    header = re.search(r"^\| preset \| parameters at vocab 256 \(bytes\) \|(.*)\|$", text, re.M)
    assert header, "the table by vocab is gone"
    vocabs = [256] + [int(v.strip().replace(",", "")) for v in header.group(1).split("|")]
    rows = {m.group(1): [int(x.strip().replace(",", "")) for x in m.group(2).split("|")]
            for m in re.finditer(r"^\| `([a-z0-9-]+)` \| ([0-9, |]+)\|$", text, re.M)}
    assert set(rows) == set(PRESETS)
    for name, counts in rows.items():
        assert counts == [ModelConfig.from_dict({"preset": name, "vocab_size": v}).n_params() for v in vocabs], name
