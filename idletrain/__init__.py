"""The `idletrain` command line.

    cli.py    argparse front end: coordinator serve, run create, worker run, status, demo, bench
    demo.py   one-machine demo: a coordinator and N worker processes over real loopback HTTP
"""
