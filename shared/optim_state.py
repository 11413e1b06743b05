"""An optimizer's state keyed by parameter name, as plain tensors and numbers (pure: no I/O).

The worker checkpoints it (worker/state.py) and commits to it at a round's start; the coordinator's
replay spot-check loads a worker's committed state into a fresh optimizer of its own
(shared/algorithms/start_state.py). Nothing here is pickled: tensors stay tensors, the rest JSON.
"""

from __future__ import annotations

import dataclasses

import torch

_JSON_SCALARS = (bool, int, float, str, type(None))


@dataclasses.dataclass
class OptimizerState:
    """An AdamW state by parameter name: tensors (exp_avg, exp_avg_sq, step) and any plain
    numbers, plus each param group's hyper-parameters (without the parameters)."""

    tensors: dict[str, dict[str, torch.Tensor]]
    scalars: dict[str, dict[str, bool | int | float | None]]
    groups: list[dict]


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> OptimizerState:
    """The optimizer's state keyed by the model's parameter names: detached CPU copies, so later
    steps do not change what was taken."""
    names = _param_names(model)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict] = {}
    for p, st in opt.state.items():
        name = names.get(id(p))
        if name is None:
            raise ValueError("the optimizer holds a parameter the model does not name")
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(name, {})[key] = value.detach().to("cpu", copy=True).contiguous()
            elif isinstance(value, _JSON_SCALARS):
                scalars.setdefault(name, {})[key] = value
            else:
                raise TypeError(f"optimizer state {name}/{key} is a {type(value).__name__}, not a tensor or number")
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
               if k != "params" and isinstance(v, (*_JSON_SCALARS, tuple))} for g in opt.param_groups]
    return OptimizerState(tensors=tensors, scalars=scalars, groups=groups)


def load_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, saved: OptimizerState) -> None:
    """Put `saved` into a freshly made optimizer for `model` (same parameter names and shapes)."""
    own = dict(model.named_parameters())
    unknown = (set(saved.tensors) | set(saved.scalars)) - set(own)
    if unknown:
        raise ValueError(f"optimizer state for parameters the model lacks: {sorted(unknown)[:5]}")
    if len(saved.groups) != len(opt.param_groups):
        raise ValueError(f"optimizer state has {len(saved.groups)} param groups, the optimizer {len(opt.param_groups)}")
    names = _param_names(model)
    fresh = opt.state_dict()
    state: dict[int, dict] = {}
    groups = []
    for live, packed, saved_group in zip(opt.param_groups, fresh["param_groups"], saved.groups, strict=True):
        for index, p in zip(packed["params"], live["params"], strict=True):
            name = names[id(p)]
            entry: dict = dict(saved.scalars.get(name, {}))
            for key, t in saved.tensors.get(name, {}).items():
                if key != "step" and t.shape != p.shape:
                    raise ValueError(f"optimizer state {name}/{key}: shape {tuple(t.shape)} != {tuple(p.shape)}")
                entry[key] = t.clone()  # load_state_dict keeps what it is given: never share it with `saved`
            if entry:
                state[index] = entry
        group = dict(packed)
        for key, value in saved_group.items():
            if key in group and key != "params":
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
        groups.append(group)
    opt.load_state_dict({"state": state, "param_groups": groups})
