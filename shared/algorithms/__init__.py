"""The math of a round, with no I/O (serves the worker, the coordinator and the simulator).

    inner.py     local AdamW steps, lr schedule, pseudo-gradient (snapshot - local)
    compress.py  sparsify (top-k or seeded random), quantise, error feedback
    outer.py     the merge rule: staleness weight, outer Nesterov step, delayed momentum
    robust.py    screening before the merge: norm bound, median clip/reject, direction check
    sparta.py    sparse elastic exchanges with the global model
"""
