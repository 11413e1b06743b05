"""The coordinator: hands out shards and snapshots under leases, accepts deltas, merges them.

    settings.py   CoordinatorSettings (one per process, from flags and IDLETRAIN_* variables)
    app.py        create_app(settings): FastAPI app, lifespan, merger thread
    api/          routes (thin) and the error -> HTTP mapping
    service.py    Coordinator: every operation, validated, transactional
    scheduler.py  lease policy (pure): next shard, deadlines, seeds, traffic accounting
    runtime.py    a run's live state: global weights, outer optimizer, snapshots, checkpoints, eval
    merger.py     the single merger thread: apply deltas in order, evaluate, checkpoint, GC
    models.py     database schema;  db.py  engine and sessions;  storage.py  atomic blob files
"""
