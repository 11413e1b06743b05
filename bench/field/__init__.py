"""`python -m bench field`: the real system on shaped links. A real coordinator and N real workers, each
worker in a network namespace of its own behind 10/50 Mbit/s (tc tbf), against real data-parallel
(torch.distributed over gloo: ring and parameter server, fp32, bf16, PowerSGD, int8), hivemind's
Optimizer with local updates, and one worker alone, every training process at the same capped CPU
share; loss from evaluations on a held-out test slice, lrs chosen on a disjoint validation slice,
bytes from the interfaces' counters.

    cli.py      the command line: options checked, then run
    run.py      the profiles, the order rows run in, the lr choices, results.json as rows land
    net.py      the namespaces, the bridge, the shaped veths, byte counters, CPU cgroups (Field)
    rows.py     one row: the idletrain processes or the data-parallel ranks, and their curves
    ddp.py      a data-parallel rank (`python -m bench.field.ddp SPEC RANK`): alone, ring, ps
    hive.py     a hivemind peer (`python -m bench.field.hive SPEC RANK`, hivemind's own venv)
    data.py     the run's shards and held-out slices, as the coordinator cuts them; staged shards
    report.py   time to targets, loss at equal time, speed-up over one, intervals; results.md, loss.png
"""
