"""One exception tree for everything idletrain raises on purpose.

    IdletrainError
     ├── DeltaFormatError      bytes that are not a well-formed delta (corrupt, oversized, unknown codec)
     │    └── DeltaMismatchError a well-formed delta that does not fit the model (names, shapes, ranges)
     ├── SnapshotError         a snapshot that is not the model it claims to be
     └── ConfigError           a configuration value that cannot work, with what to do instead

The coordinator maps these to HTTP answers in one place (coordinator/api/errors.py); the CLI
prints their message. Every message says what was wrong, never just "invalid".
"""


class IdletrainError(Exception):
    """Base of every deliberate idletrain error."""


class DeltaFormatError(IdletrainError, ValueError):
    """The bytes are not a well-formed delta envelope."""


class DeltaMismatchError(DeltaFormatError):
    """A well-formed delta that does not fit the model it was sent for."""


class SnapshotError(IdletrainError, ValueError):
    """A model snapshot that fails its hash, its schema or its values."""


class ConfigError(IdletrainError, ValueError):
    """A configuration that cannot work."""
