"""HTTP routes, thin adapters over coordinator.service.Coordinator.

    deps.py     Annotated dependencies: CoordinatorDep, CurrentWorker, AdminDep
    errors.py   the one mapping of errors to HTTP answers
    runs.py     create / list / status / config
    workers.py  register, lease, delta upload
    blobs.py    snapshots and shards
    dashboard.py the dashboard page (GET /) and its JSON
    metrics.py  GET /metrics (Prometheus), the app's registry and the merger's observations
"""
