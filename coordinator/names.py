"""Contributor and team names (pure): what a name may hold, and the forms names are compared in.

A contributor name is unique per run (WorkerService.register), and a registered team's name is
unique on the coordinator; both are compared by their *keys* (name_keys): two names are one name
when they share a key. A key is Unicode's confusable skeleton (UTS #39, coordinator/confusables.py:
Unicode 17.0's confusables.txt) of the name made plain: NFKC-normalised (full-width and styled
letters become plain ones), without zero-width and other invisible format characters, and without
combining marks (accents: `a` + U+0301 + `lice` is `alice`), runs of white space one space.

Case folding and skeletons disagree on one point: confusables.txt maps capital `I` to small `l`
(they look alike) but leaves small `i` alone, so folding case first loses `aIice` ~ `alice`, and
taking the skeleton first makes `ALICE` (`ALlCE`) differ from `alice`. So a name has two keys, the
skeleton of the case-folded name (`ALICE` ~ `alice`) and the skeleton of the name as written, case
folded after (`aIice` ~ `alice`), each skeleton and case fold repeated until nothing changes (digit
`0` is capital `O` is `o`). Case-insensitive as before, and a lookalike of the name as shown is
taken too: `Alice`, `ALICE`, `alice\\u200b`, full-width `ａｌｉｃｅ`, `аlice` with a Cyrillic `а`,
`aIice` with a capital `I`, `rn` for `m` and `b0b` for `bob` are each the name they look like.

Refused (ValueError, answered 422): control characters (newlines, tabs, escapes), bidirectional
overrides and isolates (they reorder what a page shows), and a name with nothing visible left.
Leading and trailing white space is dropped; an empty name is no name (an anonymous worker).
"""

from __future__ import annotations

import re
import unicodedata

from coordinator import confusables

# Zero-width and other invisible characters a lookalike name could hide (removed from the key).
INVISIBLE = frozenset("\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180e\u200b\u200c\u200d"
                      "\u2060\u2061\u2062\u2063\u2064\u3164\ufe00\ufe0f\ufeff\uffa0")
# Bidirectional embeddings, overrides and isolates: a name holding one is refused.
BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f")
MAX_KEY = 256  # characters of a folded key (NFKC can lengthen a name: one character may become 18)
_SPACES = re.compile(r"\s+")
_DROPPED = frozenset(("Cf", "Mn", "Me"))  # format characters and combining marks (Mc, spacing, stay)
_ROUNDS = 4  # skeleton and case fold settle in two; a bound all the same


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


def name_keys(name: str) -> tuple[str, ...]:
    """The forms `name` is compared in (one or two; see the module's docstring): two names are one
    name when they share one. ValueError when nothing visible is left, or a form is too long."""
    plain = _plain(name)
    keys = tuple(dict.fromkeys((_settle(plain.casefold()), _settle(plain))))
    if not all(keys):
        raise ValueError("the name has no visible characters; choose a name you can read")
    for key in keys:
        if len(key) > MAX_KEY:
            raise ValueError(f"the name is too long once normalised ({len(key)} > {MAX_KEY} characters)")
    return keys


def _plain(text: str) -> str:
    """NFKC, then decomposed (NFD) without invisible characters and combining marks."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    return "".join(ch for ch in text if ch not in INVISIBLE and unicodedata.category(ch) not in _DROPPED)


def _settle(text: str) -> str:
    """Skeleton, made plain and case-folded, until that changes nothing (a few rounds at most)."""
    for _ in range(_ROUNDS):
        settled = _plain(confusables.skeleton(text)).casefold()
        if settled == text:
            break
        text = settled
    return _SPACES.sub(" ", text).strip()
