"""What the benchmark tests share: a tiny simulator setup (a few steps of a one-layer model on a
repeated sentence and some noise), fast enough for unit tests."""

from __future__ import annotations

import numpy as np
import torch

from bench.sim import Setup
from shared.config import InnerConfig
from shared.model import ModelConfig

TINY = ModelConfig(n_layer=1, n_head=2, d_model=16, context=16)


def tiny_setup(steps_per_worker: int) -> Setup:
    rng = np.random.default_rng(0)
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 400, dtype=np.uint8)
    noise = rng.integers(0, 256, 2000, dtype=np.uint8)
    return Setup(model=TINY, inner=InnerConfig(lr=1e-2, warmup_steps=2, batch_size=4), workers=3,
                 steps_per_worker=steps_per_worker, train=torch.from_numpy(np.concatenate([text, noise])),
                 eval=torch.from_numpy(text[:2000].copy()), eval_points=2)
