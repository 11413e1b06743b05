"""HTTP routes, thin adapters over the services of coordinator/services/ (one service per router).

    deps.py       Annotated dependencies: CoordinatorDep, CurrentWorker, AdminDep, RowId; served_api
                  (every route: a worker of an API version not served gets 426)
    errors.py     the one mapping of errors to HTTP answers
    runs.py       create / list / config / pause / resume            (RunService)
    workers.py    register; the operator's list / revoke / readmit   (WorkerService)
    teams.py      registered teams: create / list / delete           (TeamService)
    leases.py     take, renew, give up a lease                       (LeaseService)
    downloads.py  snapshots, model updates, shards                   (DownloadService)
    uploads.py    delta uploads, streamed to disk                    (UploadService)
    exchanges.py  sparse exchanges, relayed to the leader if need be (ExchangeService)
    reports.py    status, evaluate now                               (ReportService)
    dashboard.py  the dashboard page (GET /) and its JSON            (ReportService)
    stats.py      daily stats, a contributor's history, progress     (StatsService)
    metrics.py    GET /metrics (Prometheus), the app's registry and the merger's observations
    bodies.py     binary request bodies: capped, timed out, streamed to a file
    relay.py      the leader's loopback listener and the relay of requests to it
"""
