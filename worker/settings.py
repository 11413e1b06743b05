"""The worker's one settings object.

Every field comes, first found wins, from: a command-line flag (passed as keyword arguments), an
IDLETRAIN_WORKER_<FIELD> variable, the TOML config file (~/.config/idletrain/worker.toml, or
--config PATH, or $IDLETRAIN_WORKER_CONFIG; keys are the field names: `when = "idle"`), the
default. load_settings() is the entry point's way in; WorkerSettings(...) alone reads no file
(tests build it directly, whatever the machine's config says).
"""

from __future__ import annotations

import contextvars
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from worker.hours import parse_hours
from worker.policy import Rules
from worker.throttle import kbps_to_bytes_per_s

ENV_PREFIX = "IDLETRAIN_WORKER_"

# The config file the settings being built read (set by load_settings for one construction).
_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("idletrain_worker_config", default=None)


MIN_MEMORY_BYTES = 1 << 30  # --max-memory's floor: a small model's round (worker/memory.py's MIN_BUDGET_BYTES)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_size(text: str) -> int:
    """"6GB" (10^9), "6GiB" (2^30), "512 MB", "6g", "1500000000" -> bytes; ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS or not float(m.group(1)) > 0:
        raise ValueError(f"{text!r} is not a size (a number and a unit: 6GB, 512MB, 8GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def default_state_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "idletrain"


def default_config_file() -> Path:
    return default_state_dir() / "worker.toml"


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    coordinator: str = Field(description="coordinator base URL, e.g. http://127.0.0.1:8000")
    run: str | None = Field(None, description="the run to train; none (or \"auto\"): follow the coordinator's "
                                              "active runs, the highest priority this worker can hold first")
    token: str | None = Field(None, description="use this token instead of registering / the stored one")
    join_key: str | None = None
    name: str | None = Field(None, max_length=64)
    team: str | None = Field(None, max_length=64)
    contributor_key: str | None = Field(None, max_length=256, description="adds this machine under `name` when "
                                        "another claimed it: the key that first registration printed")
    team_key: str | None = Field(None, max_length=256, description="joins `team` as a verified member: the key "
                                 "the operator created the team with (`idletrain team create`)")
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    threads: int | None = Field(None, ge=1, le=1024, description="torch CPU threads; default: torch's choice")
    state_dir: Path = Field(default_factory=default_state_dir, description="token, cache and training state live here")
    max_rounds: int | None = Field(None, ge=1, description="stop after this many delivered rounds")
    request_timeout_s: float = Field(60.0, gt=0)
    max_retries: int = Field(8, ge=0, description="attempts per request on network errors and 5xx")
    max_params: int | None = Field(
        None, ge=1, description="refuse runs whose model has more parameters, or whose rounds (batch x context) "
                                "need more memory than that many parameters' training would (the coordinator is "
                                "not trusted to size it); default: what this machine's available memory holds "
                                "(worker/memory.py)")
    micro_batch: int | None = Field(
        None, ge=1, le=4096, description="the most sequences per forward/backward pass: a step's batch is split into "
                                         "micro-batches, their gradients summed before the one optimizer step (the "
                                         "same step); default: the run's micro_batch_size, split further when this "
                                         "machine's memory budget (--max-params) needs it")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA and MPS where the device computes bf16, fp32 on CPU; "
                            "fp32; bf16: autocast on any device. Weights, optimizer state and deltas stay fp32")
    activation_checkpointing: bool = Field(
        False, description="recompute each block's activations in the backward pass instead of keeping them: less "
                           "memory, about a third more compute")
    checkpoint_every_steps: int = Field(
        25, ge=0, description="save the round in flight every N local steps (0: only at round end), so a "
                              "kill or a laptop's sleep resumes it; kept under state_dir/runs/")
    overlap: bool = Field(True, description="upload a round's delta in the background, one at a time, while the "
                                            "worker goes on (false: upload, then ask for the next lease, as before)")
    # -- manners (worker/policy.py) --
    when: Literal["always", "idle"] = Field("always", description="train always, or only while the machine is idle")
    idle_minutes: float = Field(5.0, ge=0, le=24 * 60, description="with when=idle: minutes without keyboard or "
                                                                    "mouse input (or CPU load) before training")
    on_battery: Literal["pause", "run"] | None = Field(
        None, description="pause on battery power, or run; default: pause with when=idle, run with when=always")
    max_other_load: float = Field(0.3, gt=0, le=1, description="with when=idle and no input idle time to go by: "
                                                               "the machine is busy while other processes use more "
                                                               "than this share of its CPUs")
    # 64 kbit/s = 8 KB/s: a coordinator cuts off a request body slower than 2 KB/s by default
    # (min_body_bytes_per_s), and a worker may send a delta and sparse exchanges at once, sharing this
    max_upload_kbps: float | None = Field(None, ge=64, description="upload limit, kilobits/s (1000 = 125 KB/s); at "
                                          "least 64, since coordinators cut off uploads slower than 16 kbit/s")
    max_download_kbps: float | None = Field(None, gt=0, description="download limit, kilobits/s")
    daily_transfer_mb: float | None = Field(None, gt=0, description="bytes sent + received per UTC day, in MB "
                                                                    "(10^6 bytes); when reached, pause until 00:00 UTC")
    hours: str | None = Field(None, description="when in the week training is allowed, by the local clock: "
                                                "\"22:00-07:00\", \"mon-fri 19:00-08:00, sat-sun 00:00-24:00\" "
                                                "(worker/hours.py); default: any time")
    max_memory: int | None = Field(None, description="the most memory a round may take, in bytes (\"6GB\" and "
                                                     "\"8GiB\" read too; at least 1GiB): leases that need more are "
                                                     "refused and micro-batches are made to fit; only ever below the "
                                                     "default from this machine's memory")
    keep_awake: bool = Field(False, description="hold off the machine's sleep while a round runs (caffeinate, "
                                                "systemd-inhibit, SetThreadExecutionState)")
    check_every_s: float = Field(2.0, gt=0, le=60, description="how often the host is checked (idle, battery) "
                                                               "and the status file written")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _CONFIG_FILE.get()
        if path is None:
            return init_settings, env_settings
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=path)

    @field_validator("coordinator")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"coordinator URL must start with http:// or https://, got {v!r}")
        return v.rstrip("/")

    @field_validator("hours")
    @classmethod
    def _hours(cls, v: str | None) -> str | None:
        if v is not None:
            parse_hours(v)  # ValueError naming the bad part
        return v

    @field_validator("max_memory", mode="before")
    @classmethod
    def _size(cls, v: object) -> object:
        n = parse_size(v) if isinstance(v, str) else v
        if isinstance(n, int | float) and not isinstance(n, bool) and n < MIN_MEMORY_BYTES:
            raise ValueError(f"{v!r} is below the least a round needs, 1GiB")
        return n

    def battery_policy(self) -> Literal["pause", "run"]:
        if self.on_battery is not None:
            return self.on_battery
        return "pause" if self.when == "idle" else "run"

    def rules(self) -> Rules:
        cap = int(self.daily_transfer_mb * 1e6) if self.daily_transfer_mb is not None else None
        return Rules(when=self.when, idle_s=self.idle_minutes * 60.0, on_battery=self.battery_policy(),
                     max_other_load=self.max_other_load, daily_transfer_bytes=cap,
                     hours=parse_hours(self.hours) if self.hours is not None else None, keep_awake=self.keep_awake)

    def upload_bytes_per_s(self) -> float | None:
        return kbps_to_bytes_per_s(self.max_upload_kbps) if self.max_upload_kbps else None

    def download_bytes_per_s(self) -> float | None:
        return kbps_to_bytes_per_s(self.max_download_kbps) if self.max_download_kbps else None


def config_file(explicit: str | Path | None, environ: Mapping[str, str] | None = None) -> Path | None:
    """The config file to read: --config, else $IDLETRAIN_WORKER_CONFIG (both must exist), else the
    default one if it exists, else none."""
    environ = os.environ if environ is None else environ
    chosen = explicit or environ.get(f"{ENV_PREFIX}CONFIG")
    if chosen:
        path = Path(chosen).expanduser()
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        return path
    path = default_config_file()
    return path if path.is_file() else None


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc}") from None


def load_settings(flags: Mapping[str, object], *, config: str | Path | None = None) -> WorkerSettings:
    """Flags (None: not given) over IDLETRAIN_WORKER_* over the config file over defaults. Raises
    ValueError (a pydantic ValidationError among them) with a message for people."""
    path = config_file(config)
    if path is not None:
        _read_toml(path)  # a clear message for broken TOML, before pydantic-settings reads it
    token = _CONFIG_FILE.set(path)
    try:
        return WorkerSettings(**{k: v for k, v in flags.items() if v is not None})
    finally:
        _CONFIG_FILE.reset(token)


def describe_errors(exc: ValidationError) -> str:
    """A ValidationError as one line, saying where a missing value can come from."""
    lines = []
    for e in exc.errors():
        loc = ".".join(map(str, e["loc"]))
        if e["type"] == "missing":
            lines.append(f"{loc}: missing (pass --{loc.replace('_', '-')}, set {ENV_PREFIX}{loc.upper()}, or "
                         f"put `{loc} = ...` in {default_config_file()})")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{loc}: not a worker setting")
        elif e["type"] == "value_error" and "error" in e.get("ctx", {}):
            lines.append(f"{loc}: {e['ctx']['error']}")  # our validators' own words, without "Value error, "
        else:
            lines.append(f"{loc}: {e['msg']}")
    return "; ".join(lines)


def resolve_state_dir(flag: str | Path | None, *, config: str | Path | None = None) -> Path:
    """The state dir for `idletrain worker pause|resume|status`, by the worker's own precedence:
    --state-dir, $IDLETRAIN_WORKER_STATE_DIR, `state_dir` in the config file, the default."""
    if flag:
        return Path(flag).expanduser()
    env = os.environ.get(f"{ENV_PREFIX}STATE_DIR")
    if env:
        return Path(env).expanduser()
    path = config_file(config)
    if path is not None:
        value = _read_toml(path).get("state_dir")
        if isinstance(value, str) and value:
            return Path(value).expanduser()
    return default_state_dir()
