"""The coordinator: hands out shards and snapshots under leases, accepts deltas, merges them.

    settings.py     CoordinatorSettings (one per process, from flags and IDLETRAIN_* variables)
    app.py          create_app(settings): FastAPI app, lifespan, merger thread, the election
    api/            routes (thin, one service each) and the error -> HTTP mapping
    services/       the operations, one service per resource (runs, recovery, workers, leases,
                    downloads, uploads, exchanges, reports), built and held by Coordinator
    queries/        every database statement, by table: typed functions over a Connection
    merger.py       the single merger thread: apply deltas in order, evaluate, checkpoint, GC
    runtime.py      a run's live state: global weights, outer optimizer, robust screening, snapshots,
                    eval
    exchange_folding.py  the live state's side of sparse exchanges: screen, clip, blend, descent guard
    checkpoints.py  a run's live state to and from its rotated checkpoints
    storage.py      named blobs (BlobStore, the local filesystem's: atomic writes) and a run's layout
    scheduler.py    lease policy (pure): deadlines, lifetimes, seeds, traffic accounting
    trust.py        worker standing (pure): ok / throttled / banned from robust merging's verdicts
    voices.py       which tokens speak as one (pure): tokens of one address share a voice, a weight, a standing
    credit.py       contributors' credit (pure): merged tokens times a quick-return bonus
    spotcheck.py    replay spot-checks' policy (pure): which leases are sampled, by which bounds judged
    names.py        contributor and team names (pure): what they may hold, the forms compared
    confusables.py  Unicode's confusable skeletons (UTS #39) from unicode/confusables.txt (pure)
    stats.py        contributors' stats (pure): daily rows, history, the daily summary, run progress
    ratelimit.py    per-worker (and per-address) token buckets -> 429 + Retry-After
    limits.py       HTTP-layer bounds: body caps, uploads and exchanges in flight, validation slots
    connections.py  the HTTP server's bounds per connection: head deadline, body rate floor, connections
                    per address (the uvicorn protocol `serve` runs); connection_bounds.py their rules (pure)
    traffic.py      bytes moved, counted in memory and written once a second
    leader.py       which process merges: the merger lock, leader.json
    timing.py       Server-Timing: where each answer's time went
    errors.py       the errors services raise (api/errors.py maps them to HTTP)
    admin.py        the operator's admin token: given, or generated into data_dir/admin_token (0600)
    hosts.py        Host header validation (DNS rebinding): the pure check and its ASGI middleware
    corpora.py      which corpus paths a run may read (pure): the allowed folders, symlinks resolved
    datasets.py     a run's tokens from a raw corpus or a prepared folder (streamed): shards, eval, tokenizer
    models.py       the database schema;  db.py  the engine and Database;  migrate.py, migrations/
    static/         dashboard.html, the page GET / serves
    unicode/        confusables.txt (Unicode 17.0's, as ICU 78.3 compiled it) and its license
"""
