"""The merge rule in the coordinator's form (`FlatOuter`): every tensor laid end to end in one flat
vector, and the dense momentum pass of shared/algorithms/outer.py made lazy. The same rule as
`outer.apply_delta`, bit for bit below LAZY_MIN_PARAMS parameters, within a few ulps of
FOLD_GAIN * |m| above it (tests/shared/algorithms/test_outer.py pins both). lr below is the open
group's (outer.group_lr: the warm-up's ramp over the first `warmup` groups, counted in `groups`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import torch

from shared import kernels
from shared.algorithms.outer import OuterState, group_lr, lookahead_gain, outer_step
from shared.codec import FlatDelta
from shared.config import OuterConfig

FOLD_GAIN = 64.0  # fold C into the weights once T holds more than this x m (float error ~ FOLD_GAIN ulps of m)
MIN_SCALE = 2.0 ** -60  # rescale M (M = m, s = 1) once the momentum's scale nears this
LAZY_MIN_PARAMS = 1 << 22  # below this the dense step is cheap: keep apply_delta's arithmetic bit for bit


class FlatOuter:
    """The same merge rule as `apply_delta` on all tensors laid end to end, with the dense
    momentum step replaced by two scalars and a sparse update.

    Kept: T, M (flat fp32 vectors), scalars s > 0 and C >= 0, the group's pending deltas (w g,
    sparse), so that

        weights  theta = T - C * M
        momentum m     = s * M
        accumulator    = the sum of the pending deltas

    A delta:        w g joins the pending list; T -= lr/G * w g is deferred to the group's end
                    (or an earlier flush(): an exchange writing the weights), where it joins
                    the momentum step's own scatter into T: one random pass saved per delta.
    Momentum step:  s' = mu s; D = acc / (G s') (sparse: the group's elements only); M += D;
                    Nesterov:   T += C D,  C' = C + lr mu s'
                    heavy-ball: C' = C + lr mu s,  T += C' D
    which is exactly m' = mu m + acc / G and theta' = theta - lr mu m' (Nesterov; heavy-ball uses
    the old m) on every element, touched or not, up to float rounding (lr may differ from group
    to group: C is the sum of each step's lr mu s): O(k) per delta and per
    group instead of a dense pass over 3 n. Rounding: T carries (C/s) m on top of the weights, so
    once C/s exceeds FOLD_GAIN (for mu = 0.2 every 5th group, for 0.9 every ~24th) C is folded
    into the weights (T -= C M, C = 0: one dense pass over T and M), keeping the error of theta
    within a few ulps of FOLD_GAIN * |m|; M itself is rescaled (M = m, s = 1) only when s falls
    below MIN_SCALE. mu = 0 steps densely every group (m = acc/G).

    lazy=False (the default below LAZY_MIN_PARAMS parameters, where a dense step is cheap): the
    momentum step is apply_delta's own dense step, tensor by tensor, and the
    weights equal apply_delta's bit for bit; s = 1 and C = 0 throughout.
    """

    def __init__(self, *, shapes: Mapping[str, tuple[int, ...]], t: torch.Tensor, m: torch.Tensor,
                 scale: float = 1.0, carry: float = 0.0, in_group: int = 0, groups: int = 0,
                 pending: list[tuple[torch.Tensor | None, int, torch.Tensor]] | None = None,
                 lazy: bool | None = None, applied: int | None = None, share: float = 0.0) -> None:
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        self.offsets: dict[str, int] = {}
        pos = 0
        for name, shape in self.shapes.items():
            self.offsets[name] = pos
            pos += int(np.prod(shape, dtype=np.int64))
        self.n = pos
        self.lazy = pos >= LAZY_MIN_PARAMS if lazy is None else bool(lazy)
        if t.shape != (pos,) or m.shape != (pos,):
            raise ValueError(f"flat state of {tuple(t.shape)} / {tuple(m.shape)} does not fit {pos} parameters")
        self.t, self.m = t, m
        self.scale, self.carry = float(scale), float(carry)
        self.in_group = in_group
        self.groups = int(groups)  # momentum steps done (OuterState.groups): the open group's lr
        # (global indices or None for a dense run, offset of a dense run, weighted values)
        self.pending: list[tuple[torch.Tensor | None, int, torch.Tensor]] = list(pending or [])
        # the first `applied` pending deltas are in T already; the rest owe T -= share * (w g)
        self.applied = len(self.pending) if applied is None else int(applied)
        self.share = float(share)
        # lazy form: the group's dense runs summed in place, (offset, numel) -> sum of w g (their
        # share is in T already), so dense deltas cost one buffer per run, not one per delta
        self.dense_acc: dict[tuple[int, int], torch.Tensor] = {}

    # -- conversions -------------------------------------------------------------------------

    @classmethod
    def from_state(cls, state: OuterState, shapes: Mapping[str, tuple[int, ...]] | None = None, *,
                   lazy: bool | None = None) -> FlatOuter:
        """The flat form of `state` (copies it): T = weights, M = momentum, s = 1, C = 0."""
        shapes = {n: tuple(t.shape) for n, t in state.params.items()} if shapes is None else shapes
        t = torch.cat([state.params[n].detach().reshape(-1).to(torch.float32) for n in shapes])
        m = torch.cat([state.momentum[n].detach().reshape(-1).to(torch.float32) for n in shapes])
        acc = torch.cat([state.accum[n].detach().reshape(-1).to(torch.float32) for n in shapes])
        out = cls(shapes=shapes, t=t, m=m, in_group=state.in_group, groups=state.groups, lazy=lazy)
        support = torch.nonzero(acc).reshape(-1)
        if 4 * support.numel() > out.n:  # the group so far, as one dense run (dense deltas)
            if out.lazy:
                out.dense_acc[(0, out.n)] = acc
            else:
                out.pending.append((None, 0, acc))
        elif support.numel():  # or as one sparse pending delta
            out.pending.append((support, 0, acc[support].clone()))
        out.applied = len(out.pending)
        return out

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: flat[o:o + int(np.prod(s, dtype=np.int64))].view(s) for (n, s), o
                in zip(self.shapes.items(), self.offsets.values())}

    def weights_flat(self) -> torch.Tensor:
        """theta = T - C M - share * (the deltas not yet in T) (T itself, not a copy, when that is all)."""
        theta = self.t
        if self.applied < len(self.pending):  # what flush() would make of T, in the same order
            theta = theta.clone()
            self._scatter(theta, [-self.share] * (len(self.pending) - self.applied), start=self.applied)
        if self.carry != 0.0:
            theta = theta.sub_(self.m, alpha=self.carry) if theta is not self.t else torch.sub(theta, self.m,
                                                                                               alpha=self.carry)
        return theta

    def published_flat(self, cfg: OuterConfig) -> torch.Tensor:
        """`published` on the flat form, with the same arithmetic (bit for bit where the weights
        are apply_delta's): theta - c acc, one dense buffer for acc; T itself when the gain c is 0
        (read it, don't write it)."""
        theta = self.weights_flat()
        c = lookahead_gain(self.in_group, cfg, groups=self.groups)
        if c == 0.0:
            return theta
        return self.accum_flat().mul_(-c).add_(theta)  # == theta - c * acc exactly (negation is exact)

    def flush(self) -> None:
        """Put the deferred T -= share * (w g) of the pending deltas into T (before writing T directly)."""
        if self.applied < len(self.pending):
            self._scatter(self.t, [-self.share] * (len(self.pending) - self.applied), start=self.applied)
            self.applied = len(self.pending)

    def momentum_flat(self) -> torch.Tensor:
        return self.m if self.scale == 1.0 else self.m * self.scale

    def accum_flat(self) -> torch.Tensor:
        acc = torch.zeros(self.n, dtype=torch.float32)
        self._scatter(acc, [1.0] * len(self.pending))
        for (off, numel), run in self.dense_acc.items():
            acc[off:off + numel].add_(run)
        return acc

    def params(self) -> dict[str, torch.Tensor]:
        """The current global model, name -> tensor (views of T while C = 0: read, don't write)."""
        return self.views(self.weights_flat())

    def to_state(self) -> OuterState:
        """The plain form (copies): what OuterState and apply_delta would hold now."""
        return OuterState(params=self.views(self.weights_flat().clone()),
                          momentum=self.views(self.momentum_flat().clone()),
                          accum=self.views(self.accum_flat()), in_group=self.in_group, groups=self.groups)

    def checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Exactly this state (the scaled form as is, so a restart continues bit for bit): tensors,
        metadata. The counters in_group and groups travel beside it (from_checkpoint takes them)."""
        tensors = {"flat/t": self.t, "flat/m": self.m}
        for i, (idx, off, vals) in enumerate(self.pending):
            tensors[f"pending/{i}/values"] = vals.contiguous()
            if idx is not None:
                tensors[f"pending/{i}/indices"] = idx.contiguous()
        meta = {"outer_form": "flat1", "outer_scale": repr(self.scale), "outer_carry": repr(self.carry),
                "outer_applied": str(self.applied), "outer_share": repr(self.share),
                "outer_layout": json.dumps([[n, list(s)] for n, s in self.shapes.items()]),
                # per pending delta: the offset of a dense run, or null for a sparse one (its indices travel)
                "outer_pending_dense": json.dumps([off if idx is None else None for idx, off, _ in self.pending]),
                "outer_dense_acc": json.dumps([list(key) for key in self.dense_acc])}
        for (off, numel), run in self.dense_acc.items():
            tensors[f"dense_acc/{off}/{numel}"] = run.contiguous()
        return tensors, meta

    @classmethod
    def from_checkpoint(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str], *,
                        in_group: int, groups: int, lazy: bool | None = None) -> FlatOuter:
        shapes = {n: tuple(s) for n, s in json.loads(meta["outer_layout"])}
        pending = []
        for i, off in enumerate(json.loads(meta["outer_pending_dense"])):
            vals = tensors[f"pending/{i}/values"].to(torch.float32)
            pending.append((None, off, vals) if off is not None else (tensors[f"pending/{i}/indices"], 0, vals))
        out = cls(shapes=shapes, t=tensors["flat/t"].to(torch.float32), m=tensors["flat/m"].to(torch.float32),
                   scale=float(meta["outer_scale"]), carry=float(meta["outer_carry"]), in_group=in_group,
                   groups=groups, pending=pending, lazy=lazy, applied=int(meta.get("outer_applied", len(pending))),
                   share=float(meta.get("outer_share", "0.0")))
        for off, numel in json.loads(meta.get("outer_dense_acc", "[]")):
            out.dense_acc[(off, numel)] = tensors[f"dense_acc/{off}/{numel}"].to(torch.float32)
        return out

    # -- sparse reads and writes of the weights (exchanges) ------------------------------------

    def weights_at(self, idx: torch.Tensor) -> torch.Tensor:
        """theta at global indices idx (flushes the deferred part of the pending deltas first)."""
        self.flush()
        t = torch.index_select(self.t, 0, idx)
        return t if self.carry == 0.0 else t.sub_(torch.index_select(self.m, 0, idx), alpha=self.carry)

    # -- the merge rule --------------------------------------------------------------------------

    def open_share(self, cfg: OuterConfig) -> float:
        """What one unit of a delta's weight moves the weights by now: the open group's lr over G."""
        return group_lr(self.groups, cfg) / cfg.group

    def apply(self, delta: FlatDelta, *, weight: float, cfg: OuterConfig, count: bool = True) -> None:
        """apply_delta for a decoded FlatDelta (same arithmetic per element, momentum step lazily).
        count=False: a compensation (`compensate`), which joins the open group's sum but is no
        member of it (the group still closes after cfg.group deltas)."""
        share = self.open_share(cfg)
        if self.applied < len(self.pending) and share != self.share:
            self.flush()  # a config change mid-group: settle what is owed at the old share
        self.share = share
        now = not self.lazy  # the plain form applies its share at once, as apply_delta does
        if delta.values.size:
            idx = torch.from_numpy(delta.indices)
            vals = torch.from_numpy(np.asarray(delta.values, dtype=np.float32)) * weight
            if now:
                self.t.index_add_(0, idx, vals, alpha=-share)
            self.pending.append((idx, 0, vals))
        for off, v in delta.dense:
            vals = torch.from_numpy(np.asarray(v, dtype=np.float32)) * weight
            self.t[off:off + vals.numel()].sub_(vals, alpha=share)  # sequential: nothing to gain by deferring
            if now:
                self.pending.append((None, off, vals))
            elif (off, vals.numel()) in self.dense_acc:
                self.dense_acc[(off, vals.numel())].add_(vals)
            else:
                self.dense_acc[(off, vals.numel())] = vals
        if now:
            self.applied = len(self.pending)
        if not count:
            return
        self.in_group += 1
        if self.in_group >= cfg.group:
            self._momentum_step(cfg)

    def compensate(self, delta: FlatDelta, *, applied: float, cfg: OuterConfig) -> None:
        """Take back a delta merged earlier at `applied` (its weight times the share of its group: what
        moved each weight per unit of its values). Its direct step is undone exactly: the weights move
        by +applied * g. Its sum joins the open group negated, so the momentum it fed is fed back
        negated: the two momentum trails cancel as the steps go on (exactly in the limit at a
        constant lr). What later deltas learnt from the weights it had moved stays."""
        share = self.open_share(cfg)
        if applied == 0.0 or share == 0.0:
            return
        self.apply(delta, weight=-applied / share, cfg=cfg, count=False)

    def _scatter(self, target: torch.Tensor, alphas: list[float], start: int = 0) -> None:
        """target += alphas[i] * pending[start + i], delta after delta (sparse runs in one index_add_)."""
        run: list[tuple[torch.Tensor, torch.Tensor, float]] = []

        def flush() -> None:
            if len(run) == 1 or (run and all(a == run[0][2] for _, _, a in run)):
                idx = run[0][0] if len(run) == 1 else torch.cat([i for i, _, _ in run])
                vals = run[0][1] if len(run) == 1 else torch.cat([v for _, v, _ in run])
                target.index_add_(0, idx, vals, alpha=run[0][2])
            elif run:
                target.index_add_(0, torch.cat([i for i, _, _ in run]), torch.cat([v * a for _, v, a in run]))
            run.clear()

        for (idx, off, vals), alpha in zip(self.pending[start:], alphas):
            if alpha == 0.0:
                continue
            if idx is not None:
                run.append((idx, vals, alpha))
            else:
                flush()
                target[off:off + vals.numel()].add_(vals, alpha=alpha)
        flush()

    def _dense_step(self, cfg: OuterConfig) -> None:
        """apply_delta's momentum step, tensor by tensor, on the plain form (s = 1, C = 0)."""
        self.flush()
        acc = self.accum_flat()
        self.dense_acc = {}
        outer_step(self.views(self.t), self.views(self.m), self.views(acc), cfg, lr=group_lr(self.groups, cfg))
        self.pending, self.applied, self.in_group = [], 0, 0
        self.groups += 1

    def fold(self, *, rescale: bool = True) -> None:
        """T = theta, C = 0 (one dense pass over T and M); rescale: also M = m, s = 1 (the plain form)."""
        if self.carry != 0.0:
            self.t.sub_(self.m, alpha=self.carry)
        self.carry = 0.0
        if rescale and self.scale != 1.0:
            self.m.mul_(self.scale)
            self.scale = 1.0

    def _momentum_step(self, cfg: OuterConfig) -> None:
        mu, lr, group = cfg.momentum, group_lr(self.groups, cfg), cfg.group
        if not self.lazy:
            self.fold()
            self._dense_step(cfg)
            return
        s_new = mu * self.scale
        c_new = self.carry + lr * mu * (s_new if cfg.nesterov else self.scale)
        if s_new < MIN_SCALE or c_new > FOLD_GAIN * s_new:
            self.fold(rescale=s_new < MIN_SCALE)
            s_new = mu * self.scale
            c_new = lr * mu * (s_new if cfg.nesterov else self.scale)
            if s_new < MIN_SCALE:  # no momentum to speak of (mu ~ 0): the plain dense step
                self._dense_step(cfg)
                return
        c_t = (self.carry if cfg.nesterov else c_new) / (group * s_new)
        # M += D, and T += C D for every pending delta plus the deferred -share w g of those not yet
        # in T: both writes of a sparse delta in one compiled pass (kernels.scatter_pair), the same
        # float32 arithmetic as the two index_add_ runs of _scatter
        alpha_m = 1.0 / (group * s_new)
        alphas_t = [c_t if i < self.applied else c_t - self.share for i in range(len(self.pending))]
        if kernels.ready() and all(idx is not None for idx, _, _ in self.pending) and 0.0 not in alphas_t:
            for (idx, _, vals), a_t in zip(self.pending, alphas_t):
                kernels.scatter_pair(self.t, self.m, idx, vals, a_t, alpha_m)
        else:
            self._scatter(self.m, [alpha_m] * len(self.pending))
            self._scatter(self.t, alphas_t)
        for (off, numel), run in self.dense_acc.items():  # their share is in T already: C D only
            self.m[off:off + numel].add_(run, alpha=1.0 / (group * s_new))
            if c_t:
                self.t[off:off + numel].add_(run, alpha=c_t)
        self.dense_acc = {}
        self.scale, self.carry = s_new, c_new
        self.pending, self.applied, self.in_group = [], 0, 0
        self.groups += 1
