"""Benchmarks (one command each, results + a plot).

    convergence.py  `idletrain bench convergence`: DDP vs DiLoCo vs SPARTA vs compressed, same tokens
"""
