"""Benchmarks (one command each, results + a plot).

    convergence.py  `idletrain bench convergence`: DDP vs DiLoCo vs SPARTA vs compressed, same tokens
    merge.py        `idletrain bench merge`: merges/s stage by stage against a bare index_add_ bound
    load.py         `idletrain bench load`: N simulated workers over loopback HTTP, lease/upload p99 per N
"""
