"""The volunteer's worker: pulls work, trains locally (CPU, CUDA or MPS), pushes deltas.
It only ever connects outward.

    settings.py  WorkerSettings (flags, IDLETRAIN_WORKER_* variables)
    client.py    CoordinatorClient: the only module that speaks HTTP (httpx)
    trainer.py   LocalTrainer: one round of local steps -> encoded delta (no network); device pick
    state.py     StateStore: the round in flight and any unsent delta, saved atomically for resume
    loop.py      Worker: lease -> snapshot -> shard -> train -> push; token store, shard cache, Ctrl-C
"""
