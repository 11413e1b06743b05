"""The coordinator's one settings object: built in the entry point, passed down, never global."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class CoordinatorSettings(BaseSettings):
    """Every field can also come from the environment as IDLETRAIN_<FIELD>."""

    model_config = SettingsConfigDict(env_prefix="IDLETRAIN_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    data_dir: Path = Path("./idletrain-data")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite in data_dir")
    admin_token: str | None = Field(None, min_length=16, description="required for operator actions when set")
    max_upload_bytes: int = Field(64 << 20, ge=1024, description="largest delta body accepted")
    snapshot_keep: int = Field(32, ge=2, description="recent snapshot versions kept on disk (a worker whose "
                                                     "last version is among them downloads only the change)")
    checkpoint_every: int = Field(20, ge=1, description="versions between merger checkpoints")
    keep_deltas: bool = Field(False, description="keep every received delta file and sparse exchange body: an "
                              "audit trail, and what a rebuild from version 0 needs should no checkpoint survive. "
                              "Off: those that all kept checkpoints already hold are deleted (a 124M model at "
                              "p = 0.1% receives ~10 GB of deltas a day at one a second)")
    snapshot_every: int = Field(1, ge=1, description="write a snapshot every N merged versions, and whenever the "
                                                     "queue runs dry; leases hand out the newest snapshot (raise it "
                                                     "for large models: a 124M snapshot takes seconds to write)")
    snapshot_duty: float = Field(0.2, gt=0, le=1, description="most of the merger's time snapshots may take: a "
                                  "snapshot due (snapshot_every, or the queue ran dry) waits until the last one's "
                                  "cost is at most this share of the time since it began, and the newest version "
                                  "gets its snapshot once the merger is idle and that allows. Snapshots under "
                                  "0.25 s are never held back")
    keep_alive_s: int = Field(75, ge=1, le=3600, description="seconds an idle HTTP connection stays open; above "
                                                             "the clients' own pool expiry (httpx: 5 s), so a client "
                                                             "never sends on a connection the server is closing")
    merge_idle_s: float = Field(0.05, gt=0, description="merger's sleep when nothing is queued")
    processes: int = Field(1, ge=1, le=256, description="HTTP processes `serve` starts on one port (PostgreSQL "
                                                         "only); one of them merges at a time")
    relay: bool = Field(False, description="the merging process also listens on a free loopback port (written to "
                                           "data_dir/leader.json) where the other coordinator processes on the "
                                           "same database relay exchanges and evaluations; `serve` turns it on "
                                           "with PostgreSQL")
    leader_poll_s: float = Field(1.0, gt=0, le=60, description="how often a process asks for the merger lock "
                                                               "(takeover time after the leader dies)")
    eval_threads: int = Field(1, ge=1, le=256, description="torch threads for merging and evaluation")
    # Per-worker rate limits (requests per second, burst); 0 turns one off. Over it: 429 + Retry-After.
    lease_rate: float = Field(2.0, ge=0, description="lease requests per second per worker")
    lease_burst: float = Field(20.0, ge=1)
    upload_rate: float = Field(2.0, ge=0, description="delta uploads per second per worker")
    upload_burst: float = Field(20.0, ge=1)
    exchange_rate: float = Field(100.0, ge=0, description="sparse exchanges per second per worker")
    exchange_burst: float = Field(200.0, ge=1)
    register_rate: float = Field(1.0, ge=0, description="worker registrations per second per client address")
    register_burst: float = Field(100.0, ge=1)

    @model_validator(mode="after")
    def _safe_listen(self) -> CoordinatorSettings:
        if self.admin_token is None and not _is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host} without an admin token: set IDLETRAIN_ADMIN_TOKEN "
                "(16+ characters) or listen on 127.0.0.1")
        return self

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'idletrain.sqlite3').resolve()}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
