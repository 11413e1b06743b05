"""Benchmarks (one command each, results + a plot), run from a source checkout: `python -m bench NAME`
(`pip install -e '.[bench]'` first). Not part of the installed package; `idletrain bench NAME` forwards
here when this folder is importable.

    __main__.py            the command line: one subcommand per benchmark, its options checked
    field/                 `field`: the real coordinator and workers in network namespaces on shaped links
                           against real data-parallel (ring, parameter server, compressed) and one worker
                           alone (a package: its runner, rows, network, report)
    convergence.py         `convergence`: DDP vs DiLoCo vs SPARTA vs compressed, same tokens
    convergence_long.py    `convergence --profile long`: replicas 1-8 at 100 rounds, captured gain, algorithms
    convergence_long_report.py  the long profile's captured gains, results.md and loss.png (a panel per
                           replica count)
    regime.py              `regime`: the run length from which the long-run defaults win (the rule that
                           chooses a run's regime, shared/config.py), short- vs long-run rows per length
    regime_report.py       regime's results.md and gain.png
    sim.py                 the in-process simulator of N workers that convergence runs
    moments.py             the simulator's DES-LOC: AdamW states averaged across workers every few rounds
    averaging.py           `averaging`: where averaging AdamW workers loses against ddp, against oracles
    merge.py               `merge`: merges/s stage by stage against a bare index_add_ bound; the run,
                           the deltas' model sizes, and (g) Merger.step on a SQLite coordinator
    merge_stages.py        merge's stages (a)-(f), the synthetic deltas, the Stage row and its timing
    merge_report.py        merge's goals, results.md and stages.png
    load.py                `load`: N simulated workers over loopback HTTP, lease/upload p99 per N; the run
    load_client.py         load's simulated workers: their deltas, registration, one client process
    load_coordinator.py    load's coordinator subprocess and database: schema, env, status, DB reads, stop
    load_probes.py         load's CPU (process tree, PostgreSQL, machine), pg sessions, Server-Timing phases
    load_report.py         load's goal per N, results.json, results.md and p99.png
    utilisation.py         `utilisation`: the share of wall time a real worker computes, overlap off/on
    utilisation_report.py  utilisation's results.md and utilisation.png
    models.py              `models`: bytes vs BPE, GPT vs Llama-style, the same training bytes, bits per byte
    wallclock.py           `wallclock`: loss against simulated wall-clock over home links, ddp (fp32, int8,
                           PowerSGD) vs one worker alone vs the default vs the best compressed rows; the run
    wallclock_cli.py       wallclock's command line: options checked, the run, the long profile, --reclock
    wallclock_ddp.py       wallclock's ddp with compressed gradients (int8 or PowerSGD, error feedback)
    wallclock_clock.py     wallclock's clock: a run's loss-against-tokens curve put on simulated seconds
    wallclock_long.py      `wallclock --profile long`: the long convergence profile's curves on the clocks
    wallclock_reclock.py   `wallclock --reclock DIR`: an earlier run's curves on new links or a new step time
    wallclock_report.py    wallclock's numbers (time to targets, loss at equal time, captured gain), outputs
    links.py               the link model: bytes -> seconds, ring all-reduce, ddp's and the worker's overlap
    powersgd.py            PowerSGD rank-r gradient compression with error feedback (Vogels et al. 2019)
    numbers.py             rounding of reported numbers (significant digits, percentiles)
    sizing.py              docs/sizing.md's table: memory, disk, bandwidth per model size and round, from
                           the code's estimators (`python -m bench.sizing` prints it; a test compares)
    hostile.py             docs/reliability.md's hostile-coordinator and oversized-record figures: a real
                           worker against 3 GiB answers, `data prepare` of one huge line (`python -m
                           bench.hostile` prints them)
    spotcheck.py           `spotcheck`: honest, replayed, borrowed, stale and crafted deltas against the
                           replay spot-check at rate 1, first and later leases, fp32 and bf16 autocast
    spotcheck_sparta.py    `spotcheck-sparta`: honest, idle, shifted, stale and borrowed sparta exchanges
                           against the replay spot-check at rate 1, fp32 and bf16 autocast
"""
