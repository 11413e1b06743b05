"""The volunteer's worker: pulls work, trains locally (CPU, CUDA or MPS), pushes deltas.
It only ever connects outward, and it minds its host.

    settings.py  WorkerSettings (flags > IDLETRAIN_WORKER_* variables > worker.toml > defaults)
    client.py    CoordinatorClient: the only module that speaks HTTP (httpx); paced, metered, capped
    trainer.py   LocalTrainer: one round of local steps -> encoded delta (no network); device pick;
                 a gate between steps for pauses
    state.py     StateStore: the round in flight and any unsent delta, saved atomically for resume
    loop.py      Worker: lease -> snapshot -> shard -> train -> push; token store, shard cache, Ctrl-C
    memory.py    how large a model this machine trains (--max-params' default); leases sized on meta
    policy.py    may it train now, and if not why: one pure function (idle, battery, cap, pause)
    host.py      what the machine does: input idle time, battery, CPU load (parsers + readers)
    governor.py  runs the policy while the worker works: waits, pauses mid-round, lets leases go
    throttle.py  token buckets for --max-*-kbps; the daily transfer count, kept across restarts
    control.py   the local control channel: control.json (pause/resume) and status.json
    progress.py  live numbers, a rich panel on a terminal, plain log lines elsewhere
"""
