"""The `idletrain` command line.

    cli/        argparse front end, one module per audience: the volunteer (worker run, pause, status),
                the operator (coordinator serve, run create/show, worker list, export, sample), the
                developer (demo; bench, forwarded to `python -m bench` in a source checkout)
    demo.py     one-machine demo: a coordinator and N worker processes over real loopback HTTP
    harness.py  local processes over loopback: a free port, waiting for /healthz (demo, bench, tests)
"""
