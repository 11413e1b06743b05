"""Unicode's confusable skeletons (UTS #39), from the table shipped beside this module (pure: the
table is package data, read once on first use; nothing is downloaded).

skeleton(X) is UTS #39's: NFD(X), each code point replaced by its prototype in confusables.txt
(default-ignorable code points by nothing), NFD again. Two strings with one skeleton look alike:
`paypal` with a Cyrillic `а`, `rn` and `m`, capital `I` and small `l`, digit `0` and capital `O`.

The table, unicode/confusables.txt, is Unicode 17.0.0's confusables.txt as ICU 78.3 compiled it (the
icukit-pyicu 78.3.1 wheel): for every code point that NFD leaves alone, its prototype under ICU's
SpoofChecker.getSkeleton, in NFD. `python -m coordinator.confusables` writes it again from the
PyICU installed (`pip install icukit-pyicu`), which the coordinator itself never needs. Unicode's
data files are under the Unicode License v3 (unicode/LICENSE).
"""

from __future__ import annotations

import functools
import sys
import unicodedata
from importlib import resources
from pathlib import Path

TABLE = "unicode/confusables.txt"


@functools.cache
def table() -> tuple[dict[int, str], str]:
    """(code point -> its prototype, the Unicode version the table says it is), read once."""
    text = resources.files("coordinator").joinpath(TABLE).read_text(encoding="utf-8")
    mapping: dict[int, str] = {}
    version = "unknown"
    for line in text.splitlines():
        if line.startswith("# Unicode:"):
            version = line.split(":", 1)[1].strip()
        if not line or line.startswith("#"):
            continue
        source, _, target = line.partition(";")
        first, _, last = source.strip().partition("..")
        prototype = "".join(chr(int(cp, 16)) for cp in target.split())
        for cp in range(int(first, 16), int(last or first, 16) + 1):
            mapping[cp] = prototype
    return mapping, version


def unicode_version() -> str:
    return table()[1]


def skeleton(text: str) -> str:
    """UTS #39's skeleton of `text` (see the module's docstring)."""
    mapping = table()[0]
    return unicodedata.normalize("NFD", unicodedata.normalize("NFD", text).translate(mapping))


# -- writing the table (a developer's tool) -------------------------------------------------------

HEADER = """\
# The prototypes of Unicode's confusables.txt (UTS #39), as coordinator/confusables.py applies them.
# Unicode: {unicode}
# Source: ICU {icu} (PyICU {pyicu}): SpoofChecker.getSkeleton of each code point that NFD leaves alone
# Each line: a code point (or a range) ; its prototype, code points in NFD (none: removed)
# Written by `python -m coordinator.confusables`. © Unicode, Inc.; Unicode License v3 (LICENSE).
"""


def icu_lines() -> tuple[str, list[str]]:
    """(the header, the table's lines), from the PyICU installed (MissingExtra when none is)."""
    from shared.extras import require

    icu = require("icu", "icu", purpose="writing the confusables table", install="pip install icukit-pyicu")
    checker, nfd = icu.SpoofChecker(), icu.Normalizer2.getNFDInstance()
    rows: list[tuple[int, str]] = []
    for cp in range(0x110000):
        ch = chr(cp)
        if 0xD800 <= cp <= 0xDFFF or (nfd.normalize(ch) != ch and unicodedata.normalize("NFD", ch) != ch):
            continue  # a surrogate, or a code point NFD always splits first
        prototype = checker.getSkeleton(0, ch)
        if prototype != ch:
            rows.append((cp, prototype))
    lines: list[str] = []
    i = 0
    while i < len(rows):  # runs of code points with one prototype (the ignorables) as one range
        j = i
        while j + 1 < len(rows) and rows[j + 1] == (rows[j][0] + 1, rows[i][1]):
            j += 1
        source = f"{rows[i][0]:04X}" + (f"..{rows[j][0]:04X}" if j > i else "")
        lines.append(f"{source} ;\t" + " ".join(f"{ord(c):04X}" for c in rows[i][1]))
        i = j + 1
    header = HEADER.format(unicode=icu.UNICODE_VERSION, icu=icu.ICU_VERSION, pyicu=icu.VERSION)
    return header, lines


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path(__file__).resolve().parent / TABLE
    header, lines = icu_lines()
    out.write_text(header + "\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {out}: {len(lines)} lines", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
