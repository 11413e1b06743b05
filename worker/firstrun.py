"""The first `idletrain worker run` on a terminal: ask whether to train always or only when idle.

When the volunteer has set no `when` (no --when flag, no IDLETRAIN_WORKER_WHEN, no `when = ...`
in the config file) and a person is at the terminal (stdin and stdout both a TTY), the worker asks
once, defaulting to idle, and writes the answer into the config file (worker.toml), so it is never
asked again. Without a terminal (a systemd or launchd service, the demo, tests) nothing is asked
and WorkerSettings' default holds: `always`, as a service set up on purpose expects.

    policy_chosen(flag, environ, config)   whether `when` is set anywhere already
    parse_answer(text)                     "idle" | "always" | None (not understood)
    ask_when(read, write)                  the question, asked until understood (3 tries, then idle)
    save_when(path, when)                  `when = "..."` added to the TOML file (created if missing)
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path

from shared.files import atomic_write

QUESTION = "Train only when this computer is idle (recommended) or always? [idle/always] (default: idle): "
TRIES = 3


def policy_chosen(flag: str | None, environ: Mapping[str, str], config: Path | None, *, prefix: str) -> bool:
    """Whether `when` comes from a flag, the environment or the config file (read as TOML; a file
    that does not parse counts as chosen: the settings' own reading says what is wrong with it)."""
    if flag is not None or environ.get(f"{prefix}WHEN"):
        return True
    if config is None or not config.is_file():
        return False
    try:
        return "when" in tomllib.loads(config.read_text())
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError):
        return True


def parse_answer(text: str) -> str | None:
    answer = text.strip().lower()
    if answer in ("", "i", "idle"):
        return "idle"
    if answer in ("a", "always"):
        return "always"
    return None


def ask_when(read: Callable[[str], str], write: Callable[[str], None]) -> str:
    """The volunteer's answer; idle on an empty line, after TRIES answers not understood, or at the
    end of input."""
    for _ in range(TRIES):
        try:
            answer = parse_answer(read(QUESTION))
        except EOFError:
            return "idle"
        if answer is not None:
            return answer
        write("Please answer idle or always.")
    return "idle"


def save_when(path: Path, when: str) -> None:
    """Add `when = "<when>"` to the TOML file at `path` (its other lines untouched; the file and its
    folder created when missing). Called only when the file has no `when` key yet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.is_file() else "# idletrain worker settings (`idletrain worker run --help`)\n"
    if text and not text.endswith("\n"):
        text += "\n"
    # a top-level key must come before any [table]: put it first after the leading comments
    lines = text.splitlines(keepends=True)
    head = 0
    while head < len(lines) and lines[head].lstrip().startswith("#"):
        head += 1
    lines.insert(head, f'when = "{when}"\n')
    atomic_write(path, "".join(lines).encode())
