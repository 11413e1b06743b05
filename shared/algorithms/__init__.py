"""The math of a round, with no I/O (serves the worker, the coordinator and the simulator).

    registry.py    the algorithms (diloco, sparta, sparta+diloco): what a round starts from, what it
                   ends with, whether it exchanges; ALGORITHMS[cfg.algorithm] instead of name tests
    inner.py       local AdamW steps, lr schedule, pseudo-gradient (snapshot - local)
    group_adamw.py AdamW normalised for the group's combined batch (the long-run inner optimiser)
    compress.py    sparsify (top-k or seeded random), quantise, error feedback
    outer.py       the merge rule: staleness weight, outer Nesterov step, delayed momentum
    flat_outer.py  the same rule on one flat vector, its momentum step lazy (the coordinator's form)
    robust.py      screening before the merge: norm bound, median clip/reject, direction check
    robust_stats.py what the screen measures of a delta: norm, cosine, agreement, peak
    spotcheck.py   the replay spot-check: re-train a lease's round, compare it with the delta sent
    start_state.py a round's start state (AdamW state, residual): its bytes, checks and moment bound
    sparta.py      sparse elastic exchanges with the global model
    exchange_screen.py  an exchange's limits from its own lease's reach; clip, blend, refuse
    sync.py        incremental model downloads: the int8 change between two versions, or from the
                   worker's own copy (update_feedback; copy_digest names a copy)
"""
