"""The coordinator's operations, one service per resource; the routes (coordinator/api/) call these.

    coordinator.py  Coordinator: builds the services, holds what they share, close()
    runs.py         RunService: create (the operator's), list, config, pause / resume
    lifecycle.py    LifecycleService: budget, epochs, priority; finishing (final eval, checkpoint, export),
                    archive, delete
    recovery.py     RecoveryService: live models from checkpoints and a replay, the reference round,
                    the newest snapshot, pruning what every kept checkpoint holds
    workers.py      WorkerService: register, authenticate, list / revoke / readmit, standing (trust)
    teams.py        TeamService: the operator's registered teams (create, list, delete); a registration's team
    leases.py       LeaseService: grant (the SQL shard pick), renew, release, expire
    downloads.py    DownloadService: snapshots, model updates (and the workers' copies they make, with
                    update_feedback), shards, the run's tokenizer
    uploads.py      UploadService: precheck, accept (validate, stage, acknowledge)
    exchanges.py    ExchangeService: sparse exchanges (sparta) with the live model
    spotchecks.py   SpotCheckService: replay spot-checks: keep a sampled delta, re-train its round, judge
    reports.py      ReportService: evaluate, status, the dashboard, /metrics' numbers
    stats.py        StatsService: contributors' daily stats and history, the daily summary, progress
    live.py         LiveRuns: the live models this process holds, leadership, each run's tensor schema
    common.py       Caller (the worker a request comes from) and small shared checks

Every operation validates first and changes nothing on a refusal. Deltas are acknowledged only
after their bytes are fsynced and their row committed. Each service reaches the database one way:
the typed statements of coordinator/queries/ on a Connection.
"""
