"""Optional extras: a module that only some commands need, imported with a one-line answer when it
is missing (`pip install 'idletrain[EXTRA]'`) instead of a traceback."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional module is not installed; str() is the one line that says what to install."""

    def __init__(self, module: str, extra: str, *, purpose: str | None = None, install: str | None = None,
                 detail: str | None = None) -> None:
        self.module, self.extra = module, extra
        self.install = install or install_hint(extra)
        need = f"{purpose} needs" if purpose else "this needs"
        state = f"which does not load ({detail})" if detail else "which is not installed"
        super().__init__(f"{need} the Python module {module!r}, {state}: {self.install}", name=module)


def install_hint(extra: str) -> str:
    """The command that installs an extra of the idletrain package."""
    return f"pip install 'idletrain[{extra}]'"


def require(module: str, extra: str, *, purpose: str | None = None, install: str | None = None) -> ModuleType:
    """`module`, imported; MissingExtra (an ImportError) when it, or a module it needs, is missing.

    purpose: what needs it, for the message ("--database-url postgresql+psycopg://..."); install:
    another install command than `pip install 'idletrain[EXTRA]'` (e.g. the bench extra of a source
    checkout: `pip install -e '.[bench]'`)."""
    try:
        return importlib.import_module(module)
    except MissingExtra:
        raise
    except ModuleNotFoundError:  # it, or a module it imports, is not installed
        raise MissingExtra(module, extra, purpose=purpose, install=install) from None
    except ImportError as exc:  # installed, but broken (e.g. psycopg without its libpq)
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MissingExtra(module, extra, purpose=purpose, install=install, detail=detail) from None


def available(module: str) -> bool:
    """Whether `module` imports (without raising on a missing one)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
