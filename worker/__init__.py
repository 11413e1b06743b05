"""The volunteer's worker: pulls work, trains locally (CPU, CUDA or MPS), pushes deltas.
It only ever connects outward, and it minds its host.

    settings.py     WorkerSettings (flags > IDLETRAIN_WORKER_* variables > worker.toml > defaults)
    client.py       CoordinatorClient: the only module that speaks HTTP (httpx); paced, metered, capped
    reading.py      an answer's body read under its cap as it streams, decoded here in bounded steps
    sizes.py        what each download of a lease can weigh, from the lease (its model, token dtype) alone
    answers.py      the coordinator's error answers by kind: transient, refusing one delta, or blocked
                    (only someone's action mends it: over the upload cap, API version, token, run gone)
    loop.py         Worker: the round it runs, stage by stage (below), until stopped; run_worker()
    project.py      no --run: follow the coordinator's active runs by priority, the next when one finishes

  a round's stages, in order
    connection.py   the coordinator reached: /healthz until it answers, its API range, the token; the
                    blocked waits (said once, shown in the status, rechecked, never an exit)
    downloads.py    the lease checked (untrusted), its base model kept current, its shard fetched
    trainer.py      LocalTrainer: one round of local steps -> encoded delta (no network); device pick;
                    the step hook (StepHook) with a gate between steps for pauses
    fit.py          how a round fits the machine: micro-batches, bf16 autocast, activation checkpointing
    exchanges.py    sparta's exchanges during a round, on a background thread
    saver.py        when the local state is written (checkpoints, the delta before its upload)
    delivery.py     the delta uploaded (with overlap, in the background), the answer settled
    prefetch.py     the next lease, base model and shard fetched near a round's end (lease_ahead)
    ledger.py       this worker's own deltas that a new lease's base does not hold yet (diloco)
    recovery.py     at start and after an outage: unsent deltas first, then the interrupted round

  local state
    state.py        StateStore: the round in flight and any unsent delta, saved atomically for resume
    start_states.py each round's start state, kept until its spot-check no longer wants it, then sent
    caches.py       TokenStore (credentials per coordinator and run), ShardCache (shards by hash)

  manners
    memory.py       how large a model this machine trains (--max-params' default); leases sized on meta
    policy.py       may it train now, and if not why: one pure function (idle, battery, cap, hours, pause)
    hours.py        --hours windows ("mon-fri 19:00-08:00"): the parser and "is now allowed" (pure)
    host.py         what the machine does: input idle time, battery, CPU load (parsers + readers)
    windows.py      the Windows probes: idle time, battery, the keep-awake call (pure parts + ctypes)
    awake.py        --keep-awake: the machine's sleep held off while a round runs
    firstrun.py     the first run on a terminal: asks always-or-idle, saves it in worker.toml
    governor.py     runs the policy while the worker works: waits, pauses mid-round, lets leases go
    lease_keeper.py renews the lease while its round makes progress
    throttle.py     token buckets for --max-*-kbps; the daily transfer count, kept across restarts
    control.py      the local control channel: control.json (pause/resume), status.json, Ctrl-C
    progress.py     live numbers, a rich panel on a terminal, plain log lines elsewhere

    distributed.py  one worker over several local processes (torchrun): rank 0 leads, the others follow
"""
