"""Contributor and team names (pure): what a name may hold, and the folded form names are compared in.

A contributor name is unique per run (WorkerService.register), compared as its *key*: the name
NFKC-normalised (full-width and styled letters become plain ones), without zero-width and other
invisible format characters, case-folded, with runs of white space made one space, and with the
cheap confusables folded to one letter (Cyrillic and Greek lookalikes of Latin letters, 0 -> o,
1 and | -> l). So `Alice`, `ALICE`, `alice\\u200b`, full-width `ａｌｉｃｅ` and `аlice` with a
Cyrillic `а` are all the same name. This is a cheap subset of Unicode's confusable skeletons (UTS
#39), not all of it: `rn` and `m` stay apart.

Refused (ValueError, answered 422): control characters (newlines, tabs, escapes), bidirectional
overrides and isolates (they reorder what a page shows), and a name with nothing visible left.
Leading and trailing white space is dropped; an empty name is no name (an anonymous worker).
"""

from __future__ import annotations

import re
import unicodedata

# Zero-width and other invisible characters a lookalike name could hide (removed from the key).
INVISIBLE = frozenset("\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180e\u200b\u200c\u200d"
                      "\u2060\u2061\u2062\u2063\u2064\u3164\ufe00\ufe0f\ufeff\uffa0")
# Bidirectional embeddings, overrides and isolates: a name holding one is refused.
BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f")
# Lookalikes of Latin letters, after NFKC and case folding: Cyrillic, Greek, digits.
CONFUSABLE = str.maketrans({
    "а": "a", "в": "b", "е": "e", "ё": "e", "һ": "h", "і": "i", "ї": "i", "ј": "j", "к": "k", "м": "m",
    "н": "h", "о": "o", "р": "p", "с": "c", "т": "t", "у": "y", "х": "x", "ѕ": "s", "ԁ": "d", "ԛ": "q",
    "ԝ": "w", "ɡ": "g", "ı": "i",
    "α": "a", "β": "b", "ε": "e", "η": "n", "ι": "i", "κ": "k", "ν": "v", "ο": "o", "ρ": "p", "τ": "t",
    "υ": "u", "χ": "x", "ω": "w",
    "0": "o", "1": "l", "|": "l",
})
MAX_KEY = 256  # characters of a folded key (NFKC can lengthen a name: one character may become 18)
_SPACES = re.compile(r"\s+")


def clean(raw: str | None, *, what: str = "name") -> str | None:
    """`raw` as stored: without leading and trailing white space, None when nothing is left.
    ValueError (its message says why) for control characters or bidirectional overrides."""
    if raw is None:
        return None
    for ch in raw:
        if ch in BIDI:
            raise ValueError(f"the {what} holds a bidirectional control character (U+{ord(ch):04X}); "
                             "use plain text")
        if unicodedata.category(ch) == "Cc":
            raise ValueError(f"the {what} holds a control character (U+{ord(ch):04X}); use plain text")
    name = raw.strip()
    return name or None


def name_key(name: str) -> str:
    """The form contributor names are compared in (see the module's docstring). ValueError when
    nothing visible is left, or the folded name is too long."""
    folded = unicodedata.normalize("NFKC", name)
    folded = "".join(ch for ch in folded if ch not in INVISIBLE and unicodedata.category(ch) != "Cf")
    folded = unicodedata.normalize("NFKC", folded.casefold()).translate(CONFUSABLE)
    folded = _SPACES.sub(" ", folded).strip()
    if not folded:
        raise ValueError("the name has no visible characters; choose a name you can read")
    if len(folded) > MAX_KEY:
        raise ValueError(f"the name is too long once normalised ({len(folded)} > {MAX_KEY} characters)")
    return folded
