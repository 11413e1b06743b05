"""docs/sizing.md's table is what bench/sizing.py computes from the code's estimators now."""

from __future__ import annotations

import re
from pathlib import Path

from bench import sizing

DOC = Path(__file__).resolve().parents[2] / "docs" / "sizing.md"


def test_the_sizing_table_in_the_docs_is_the_one_the_code_computes():
    m = re.search(r"<!-- sizing:start -->\n(.*?)\n<!-- sizing:end -->", DOC.read_text(), re.S)
    assert m is not None, "docs/sizing.md lost its table markers"
    assert m.group(1) == sizing.table(), "the sizing table is stale: paste the output of `python -m bench.sizing`"


def test_the_figures_follow_the_estimators():
    rows = {r.name: r for r in sizing.rows()}
    tiny, big = rows["tiny"], rows["llama-300m (example)"]
    assert tiny.params == 644_224 and tiny.fits and not big.fits
    assert tiny.mem_bf16 < tiny.mem_fp32 and tiny.mem_micro1 < tiny.mem_fp32
    assert tiny.snapshot == 4 * tiny.params  # fp32
    assert 7 * big.delta < big.snapshot < 8 * big.delta  # int4 with a scale per 256 values: about an eighth of fp32
