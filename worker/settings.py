"""The worker's one settings object (flags override IDLETRAIN_WORKER_* variables)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_state_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "idletrain"


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="IDLETRAIN_WORKER_", extra="forbid")

    coordinator: str = Field(description="coordinator base URL, e.g. http://127.0.0.1:8000")
    run: str
    token: str | None = Field(None, description="use this token instead of registering / the stored one")
    join_key: str | None = None
    name: str | None = Field(None, max_length=64)
    team: str | None = Field(None, max_length=64)
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    threads: int | None = Field(None, ge=1, le=1024, description="torch CPU threads; default: torch's choice")
    state_dir: Path = Field(default_factory=default_state_dir, description="token, cache and training state live here")
    max_rounds: int | None = Field(None, ge=1, description="stop after this many delivered rounds")
    request_timeout_s: float = Field(60.0, gt=0)
    max_retries: int = Field(8, ge=0, description="attempts per request on network errors and 5xx")
    max_params: int = Field(2_000_000_000, ge=1, description="refuse runs whose model has more parameters "
                                                              "(the coordinator is not trusted to size it)")
    checkpoint_every_steps: int = Field(
        25, ge=0, description="save the round in flight every N local steps (0: only at round end), so a "
                              "kill or a laptop's sleep resumes it; kept under state_dir/runs/")

    @field_validator("coordinator")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"coordinator URL must start with http:// or https://, got {v!r}")
        return v.rstrip("/")
