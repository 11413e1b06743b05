"""The coordinator: hands out shards and snapshots under leases, accepts deltas, merges them.

    settings.py   CoordinatorSettings (one per process, from flags and IDLETRAIN_* variables)
    app.py        create_app(settings): FastAPI app, lifespan, merger thread
    api/          routes (thin) and the error -> HTTP mapping
    service.py    Coordinator: every operation, validated, transactional
    scheduler.py  lease policy (pure): next shard, deadlines, seeds, traffic accounting
    trust.py      worker standing (pure): ok / throttled / banned from robust merging's verdicts
    ratelimit.py  per-worker (and per-address) token buckets -> 429 + Retry-After
    runtime.py    a run's live state: global weights, outer optimizer, robust screening, snapshots,
                  rotated checkpoints, exchanges, eval
    merger.py     the single merger thread: apply deltas in order, evaluate, checkpoint, GC
    credit.py     contributors' credit (pure): merged tokens times a quick-return bonus
    admin.py      the operator's admin token: given, or generated into data_dir/admin_token (0600)
    hosts.py      Host header validation (DNS rebinding): the pure check and its ASGI middleware
    corpora.py    which corpus paths a run may read (pure): the allowed folders, symlinks resolved
    static/       dashboard.html, the page GET / serves
    models.py     database schema;  db.py  engine and sessions;  storage.py  atomic blob files
"""
