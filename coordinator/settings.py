"""The coordinator's one settings object: built in the entry point, passed down, never global."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from coordinator import voices


class CoordinatorSettings(BaseSettings):
    """Every field can also come from the environment as IDLETRAIN_<FIELD>."""

    model_config = SettingsConfigDict(env_prefix="IDLETRAIN_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    data_dir: Path = Path("./idletrain-data")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite in data_dir")
    admin_token: str | None = Field(None, min_length=16, description="the token every operator action requires; "
                                    "default: the one in data_dir/admin_token (mode 0600), generated on first "
                                    "start (coordinator/admin.py)")
    # DNS rebinding: a browser page on evil.example whose name then resolves to 127.0.0.1 reaches
    # this server with `Host: evil.example`; only names listed here (and the loopback names and the
    # bind host, always) are answered, others get 400. Bound to 0.0.0.0 or :: and left empty: any
    # Host, since a public server's Host is whatever name the public uses (the admin token guards it).
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Host names served besides the loopback names and the bind host, "
        "comma-separated (IDLETRAIN_ALLOWED_HOSTS=train.example.org, e.g. behind nginx); `*.example.org` "
        "matches subdomains, `*` any name")
    # `run create --corpus PATH` reads PATH on this machine and serves it to workers as shards: only
    # under these folders (symlinks and `..` resolved first), else anything the coordinator can read
    # is one run away from being published.
    corpus_dirs: Annotated[list[Path], NoDecode] = Field(
        default_factory=list, description="folders a run's corpus may come from, comma-separated, besides "
        "data_dir/corpora (the built-in corpus is always allowed)")
    max_upload_bytes: int = Field(64 << 20, ge=1024, description="largest delta body accepted")
    # Uploads stream to a file in the run's data dir (never held in memory while they arrive); these
    # bound what a worker, or a crowd of slow connections, can hold open.
    max_concurrent_uploads: int = Field(2, ge=1, le=64, description="delta uploads one worker may have in flight at "
                                        "once in one process (a worker uploads a round's delta while it trains the "
                                        "next; 2 leaves room for a retry); the next gets 429 + Retry-After before "
                                        "its body is read")
    max_concurrent_exchanges: int = Field(8, ge=1, le=256, description="sparse exchanges one worker may have in "
                                          "flight at once in one process (the worker sends up to 4); over it: 429")
    body_timeout_s: float = Field(30.0, gt=0, le=600, description="seconds an upload's body may go without a byte "
                                  "before it is cut off with 408 (nothing kept): slow connections cannot pile up")
    max_validations: int = Field(4, ge=1, le=256, description="delta and exchange bodies decoded at once per "
                                 "process (each holds its decompressed body, up to the model's dense fp32 size, "
                                 "and a core); more wait up to validation_wait_s, then get 503 + Retry-After")
    validation_wait_s: float = Field(10.0, gt=0, le=600, description="longest wait for a validation slot")
    # JSON bodies (registration, run creation, operator actions) are small: a RunConfig is ~1 KB. 64 KiB
    # is 50 times that, and caps what an unauthenticated registration can make the server parse (four
    # 150 MiB registrations took 1.4 GB). Uploads have their own cap, max_upload_bytes.
    max_json_bytes: int = Field(64 << 10, ge=1024, le=16 << 20, description="largest request body of every route "
                                "but delta uploads and exchanges: 413 over it, before it is read")
    # uvicorn's own bound (`serve`): connections plus requests in flight per process before new requests
    # get 503. 200 idle-slow connections never timed out before body_timeout_s; this caps what is left.
    limit_concurrency: int = Field(1024, ge=16, le=1 << 20, description="connections and requests one coordinator "
                                   "process serves at once (uvicorn limit_concurrency); over it: 503")
    # The connection's own bounds (coordinator/connections.py), below the app: a socket that sends nothing,
    # a head or a body that trickles, and one address holding many connections. 1,100 idle sockets made
    # every other request 503 while they stayed open; 10 B/s bodies held their connections for minutes.
    head_timeout_s: float = Field(20.0, gt=0, le=600, description="seconds a request's head (request line and "
                                  "headers, well under 1 KB from a worker) may take to arrive in full, from the "
                                  "connection's start, or from its first byte on a kept-alive connection; then 408 "
                                  "and close (a connection that sent nothing is closed)")
    body_grace_s: float = Field(10.0, ge=0, le=600, description="seconds a request body may arrive at any pace "
                                "before min_body_bytes_per_s applies (a TCP connection's slow start, a worker "
                                "resuming from sleep)")
    # 2 KiB/s is 16 kbit/s: a 1 Mbit/s home uplink is 60 times it, and a worker's --max-upload-kbps is at
    # least 64 (8 KB/s: a delta and exchanges at once still get the floor each). A floor of 1 MB/s would
    # cut off a volunteer on such a link mid-delta (64 MiB at 1 Mbit/s take ~9 minutes); 10 B/s, the
    # trickle that held connections for minutes, is cut when the grace ends.
    min_body_bytes_per_s: int = Field(2048, ge=0, le=1 << 30, description="a request body must keep this average "
                                      "rate after body_grace_s (bytes since it began >= rate x (seconds - grace); "
                                      "time the coordinator itself stops reading does not count), else 408 and "
                                      "close; 0 turns it off. A body that stops entirely meets body_timeout_s first")
    # 128 of limit_concurrency's 1024: a lab of 32 workers (max_leases_per_address) behind one NAT address
    # uses a few each; one address can no longer fill the process. Believed proxies are exempt (every
    # connection through nginx comes from nginx's address: nginx applies the limit, deploy/nginx/).
    max_connections_per_address: int = Field(128, ge=1, le=1 << 20, description="connections one client address "
                                             "(an IPv6 address by its /64) may hold open at once in one process; "
                                             "past it a new one gets 503 and is closed at once. The proxies of "
                                             "forwarded_allow_ips are exempt")
    snapshot_keep: int = Field(32, ge=2, description="recent snapshot versions kept on disk (a worker whose "
                                                     "last version is among them downloads only the change)")
    update_copies_keep: int = Field(64, ge=1, description="workers' model copies kept per run with update_feedback "
                                    "(the newest; each one fp32 model on disk): a worker whose copy is gone "
                                    "downloads the snapshot once")
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
    # X-Forwarded-For decides the client address that registrations are counted by (and leases, per
    # address): believed from nobody by default, since uvicorn's own default (believe 127.0.0.1) let any
    # local process, or a proxy on this machine that passes the header through, pick its address at will.
    forwarded_allow_ips: str = Field("", description="comma-separated addresses or networks of the reverse "
                                     "proxies whose X-Forwarded-For is believed (`127.0.0.1` for nginx on this "
                                     "machine, docs/operations.md); empty: none, the connection's address counts")
    # Tokens of one address speak as one voice in robust merging (coordinator/voices.py): four Sybils of one
    # attacker then count as one worker. The coordinator's own machine is exempt (the operator's workers, the
    # demo); a lab behind one NAT address registers a team with a key instead (docs/operations.md).
    ungrouped_addresses: str = Field("127.0.0.1,::1", description="comma-separated addresses or networks whose "
                                     "tokens each speak in their own voice in robust merging; tokens of any other "
                                     "one address (an IPv6 /64) share one voice: one weight, one standing")
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
    # A check re-trains one round on this machine's CPU (coordinator/spotcheck.py): at 0.02 the coordinator
    # trains one round for every 50 delivered, in a background thread at the lowest priority.
    spot_check_rate: float = Field(0.02, ge=0, le=1, description="share of delivered leases whose round the "
                                   "coordinator re-trains and compares with the delta sent; 0 disables")
    # A sampled lease whose upload committed to its start state is checked from that state, which the
    # worker sends once told (right after the acknowledgement, or after its restart): a check whose state
    # has not come this long after the delta fails.
    spot_check_state_wait_s: float = Field(6 * 3600.0, gt=0, description="seconds a sampled lease's committed "
                                           "start state may take to arrive before its check fails")
    # Per-worker rate limits (requests per second, burst); 0 turns one off. Over it: 429 + Retry-After.
    lease_rate: float = Field(2.0, ge=0, description="lease requests per second per worker")
    lease_burst: float = Field(20.0, ge=1)
    upload_rate: float = Field(2.0, ge=0, description="delta uploads per second per worker")
    upload_burst: float = Field(20.0, ge=1)
    exchange_rate: float = Field(100.0, ge=0, description="sparse exchanges per second per worker")
    exchange_burst: float = Field(200.0, ge=1)
    register_rate: float = Field(1.0, ge=0, description="worker registrations per second per client address")
    # 8, not 100: a burst of 100 let one address mint 58 tokens in 0.6 s and lease every shard; a lab
    # starting more machines at once gets 429 + Retry-After for the rest, which the worker waits out
    register_burst: float = Field(8.0, ge=1)
    max_leases_per_address: int = Field(32, ge=1, description="live leases of one run that one client address (an "
                                        "IPv6 address by its /64) may hold at once, but for a registered team's "
                                        "verified members, which count against the team's own cap there "
                                        "(`idletrain team create`); over it: 429 + Retry-After. A household fits; "
                                        "register a lab behind one NAT address as a team, or raise this for load "
                                        "tests whose workers all come from 127.0.0.1")
    lease_lifetime_rounds: float = Field(4.0, ge=1, description="a lease lives at most this many times the run's "
                                         "expected round (lease to delivery, recent deliveries), never less than "
                                         "its lease_ttl_s: renewals stop there and the sweep re-issues its shard")
    max_lease_lifetime_s: float = Field(6 * 3600.0, gt=0, description="a lease lives at most this long in seconds "
                                        "from its grant however it is renewed (the absolute cap above the "
                                        "expected-round one; never less than the run's lease_ttl_s)")

    # Any host may be listened on without admin_token: there is always a token (data_dir/admin_token
    # when none is given) and every operator route requires it, so loopback is no credential.

    @field_validator("allowed_hosts", "corpus_dirs", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @property
    def allowed_corpus_dirs(self) -> list[Path]:
        """Where a run's corpus may come from: data_dir/corpora, then corpus_dirs (resolved)."""
        return [p.expanduser().resolve() for p in (self.data_dir / "corpora", *self.corpus_dirs)]

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _proxy_addresses(cls, value: str) -> str:
        parts = [part.strip() for part in value.split(",") if part.strip()]
        for part in parts:
            try:
                if part != "*":
                    ipaddress.ip_network(part, strict=False)
            except ValueError:
                raise ValueError(f"{part!r} is not an address or network: list the reverse proxy's addresses, "
                                 "e.g. 127.0.0.1 or 10.0.0.0/8 (`*` believes anyone)") from None
        return ",".join(parts)

    @property
    def believed_proxies(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None:
        """forwarded_allow_ips as networks (an address is its own /32 or /128); None for `*` (anyone)."""
        parts = [part for part in self.forwarded_allow_ips.split(",") if part]
        if "*" in parts:
            return None
        return tuple(ipaddress.ip_network(part, strict=False) for part in parts)

    @field_validator("ungrouped_addresses")
    @classmethod
    def _ungrouped(cls, value: str) -> str:
        voices.networks(value)  # raises, naming the bad part
        return value

    @property
    def ungrouped_networks(self) -> list:
        """ungrouped_addresses, parsed (coordinator/voices.py)."""
        return voices.networks(self.ungrouped_addresses)

    @property
    def resolved_database_url(self) -> str:
        """database_url (postgres:// spelled postgresql://, as SQLAlchemy knows it), else SQLite in data_dir."""
        if self.database_url and self.database_url.startswith("postgres://"):
            return "postgresql://" + self.database_url.removeprefix("postgres://")
        return self.database_url or f"sqlite:///{(self.data_dir / 'idletrain.sqlite3').resolve()}"

