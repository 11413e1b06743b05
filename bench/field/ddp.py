"""The field's data-parallel rows, one process per rank (`python -m bench.field.ddp SPEC.json RANK`), each in
its machine's namespace: real torch.distributed over gloo, on the field's links.

    alone   one worker, no network: AdamW on its own shards
    ring    DistributedDataParallel (gloo's all-reduce, bucketed, overlapped with backward), with a comm
            hook for compressed rows: bf16 (torch's bf16_compress_hook, which takes only NCCL, redone for
            gloo), powersgd (torch's PowerSGD hook,
            error feedback, rank `powersgd_rank`) or int8 (ours: a shared max-abs scale, then an all-gather
            of int8 values, each rank summing what it gathered)
    ps      a parameter server through the coordinator's link: rank 0 runs in the coordinator's namespace
            and trains nothing; each step every worker sends its gradient (fp32, or int8 with its scale) to
            it and gets the mean back (fp32, or int8 re-quantised)

Every worker rank trains on the run's own shards (`bench.field.data`, staged by the driver before the clock
starts, as a coordinator holds them before workers arrive), rank r on shards r, r+N, ..., with
random windows as the idletrain worker draws them; AdamW with the run's warm-up, then a cosine to 10% over
the steps the row's time allows (rank 0 measures its first steps and tells every rank, so all step
alike). The first worker rank saves the model every `save_every_s` seconds (out/ckpt-*.pt, with the wall
time and step); the driver evaluates them afterwards, so evaluation costs the row no time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.field.data import staged_shards
from shared.algorithms.inner import scheduled_lr
from shared.config import InnerConfig
from shared.data import sample_batch
from shared.model import ModelConfig, build_model

PROBE_STEPS = 12  # steps rank 0 times before it fixes the schedule's length


def _int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().max().clamp_min(1e-12) / 127
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale.reshape(1)


def _int8_hook(state, bucket):
    """All-gather of int8 values under one scale per bucket (the max of the ranks' max-abs): each rank sends
    its bucket once as int8 and sums what it gathered; the mean, as DDP expects."""
    flat = bucket.buffer()
    world = dist.get_world_size()
    scale = flat.abs().max().reshape(1)
    dist.all_reduce(scale, op=dist.ReduceOp.MAX)
    scale = scale.clamp_min(1e-12) / 127
    q = torch.round(flat / scale).clamp(-127, 127).to(torch.int8)
    parts = [torch.empty_like(q) for _ in range(world)]
    dist.all_gather(parts, q)
    out = torch.stack([p.float() for p in parts]).sum(0) * scale / world
    fut = torch.futures.Future()
    fut.set_result(out)
    return fut


def _bf16_hook(state, bucket):
    """torch's bf16_compress_hook, which refuses gloo: the bucket all-reduced in bf16, overlapped alike."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(compressed, async_op=True).get_future()

    def back(f):
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(back)


class Saver:
    """The lead rank's checkpoints (out/ckpt-*.pt: wall time since the row's start, step, tokens, the
    model's state) every `every` seconds, and at the end with steps.json; other ranks save nothing."""

    def __init__(self, out: Path, model: torch.nn.Module, *, lead: bool, started: float, every: float,
                 tokens_per_step: int) -> None:
        self.out, self.model, self.lead, self.started, self.every = out, model, lead, started, every
        self.tokens_per_step, self.saved_at = tokens_per_step, 0.0

    def save(self, step: int, now: float, **extra) -> None:
        if self.lead:
            torch.save({"t": now - self.started, "step": step, "tokens": step * self.tokens_per_step, **extra,
                        "state": self.model.state_dict()}, self.out / f"ckpt-{step:07d}.pt")
            self.saved_at = now

    def after_step(self, step: int, **extra) -> None:
        now = time.time()
        if now - self.saved_at >= self.every:
            self.save(step, now, **extra)

    def finish(self, step: int, times: list[float], **extra) -> None:
        self.save(step, time.time(), **extra)
        if self.lead:
            (self.out / "steps.json").write_text(json.dumps({"steps": step, "step_s": times, **extra}))


COSINE = InnerConfig(lr=1.0, min_lr_ratio=0.1)  # the run's cosine, as a factor of the row's lr


def _schedule(step: int, *, warmup: int, total: int) -> float:
    """The lr's factor at `step`: a linear warm-up, then the run's cosine (inner.scheduled_lr) to 10%
    over the steps left until `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return scheduled_lr(COSINE, tokens_done=step - warmup, schedule_tokens=max(1, total - warmup))


class _Server:
    """The parameter server's side of a step: receive every worker's gradient, send the mean back."""

    def __init__(self, n: int, world: int, comm: str) -> None:
        self.n, self.world, self.comm = n, world, comm

    def step(self) -> None:
        ranks = range(1, self.world)
        if self.comm == "int8":
            qs = [torch.empty(self.n, dtype=torch.int8) for _ in ranks]
            scales = [torch.empty(1) for _ in ranks]
            for w in [dist.irecv(t, src=r) for r, t in zip(ranks, qs)] + [
                    dist.irecv(t, src=r) for r, t in zip(ranks, scales)]:
                w.wait()
            mean = sum(q.float() * s for q, s in zip(qs, scales)) / len(qs)
            q, s = _int8(mean)
            for w in [dist.isend(q, dst=r) for r in ranks] + [dist.isend(s, dst=r) for r in ranks]:
                w.wait()
            return
        grads = [torch.empty(self.n) for _ in ranks]
        for w in [dist.irecv(t, src=r) for r, t in zip(ranks, grads)]:
            w.wait()
        mean = torch.stack(grads).mean(0)
        for w in [dist.isend(mean, dst=r) for r in ranks]:
            w.wait()


def _serve(n: int, world: int, comm: str) -> int:
    """Rank 0 of a ps row: serve steps until the lead says stop."""
    server = _Server(n, world, comm)
    while True:
        go = torch.zeros(2)
        dist.broadcast(go, src=1)
        if go[0].item() == 0:
            break
        server.step()
    dist.barrier()
    return 0


def _ps_exchange(params: list[torch.Tensor], comm: str) -> None:
    """A worker's side of a ps step: its gradient to the server, the mean back into .grad."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    if comm == "int8":
        q, s = _int8(flat)
        dist.send(q, dst=0)
        dist.send(s, dst=0)
        dist.recv(q, src=0)
        dist.recv(s, src=0)
        flat = q.float() * s
    else:
        dist.send(flat, dst=0)
        dist.recv(flat, src=0)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def _ring(model: torch.nn.Module, comm: str, spec: dict) -> torch.nn.Module:
    """DDP over gloo with the row's comm hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=spec.get("bucket_mb", 4))
    if comm == "bf16":
        model.register_comm_hook(None, _bf16_hook)
    elif comm == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=spec["powersgd_rank"],
                                            start_powerSGD_iter=2, min_compression_rate=1,
                                            use_error_feedback=True, warm_start=True, random_seed=spec["seed"])
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif comm == "int8":
        model.register_comm_hook(None, _int8_hook)
    return model


def main(spec_path: str, rank: int) -> int:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    mode, comm, world = spec["mode"], spec.get("comm", "fp32").split()[0], spec["world"]
    out = Path(spec["out"])
    started = spec["started"]  # the driver's wall clock at launch: the row's time 0
    if mode != "alone":
        dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
    cfg = ModelConfig.from_dict(spec["model"])
    model = build_model(cfg, seed=spec["model_seed"])
    n = sum(p.numel() for p in model.parameters())
    deadline = started + spec["duration_s"]
    if mode == "ps" and rank == 0:
        return _serve(n, world, comm)

    trainers = world - 1 if mode == "ps" else world
    me = rank - 1 if mode == "ps" else rank
    lead = 1 if mode == "ps" else 0
    shards = staged_shards(spec["shards"])
    mine = shards[me::trainers]
    if mode == "ring":
        model = _ring(model, comm, spec)
    params = [p for p in model.parameters()]
    inner = spec["inner"]
    opt = torch.optim.AdamW(params, lr=spec["lr"], betas=(0.9, 0.95), weight_decay=inner["weight_decay"])
    gen = torch.Generator().manual_seed(spec["seed"] * 1000 + me)
    batch, context = inner["batch_size"], cfg.context
    per_shard = max(1, mine[0].numel() // (batch * context))
    total, step = None, 0
    times: list[float] = []
    saver = Saver(out, model.module if mode == "ring" else model, lead=me == 0, started=started,
                  every=spec["save_every_s"], tokens_per_step=batch * context * trainers)
    saver.save(0, time.time())
    while True:
        now = time.time()
        # the lead's clock decides for all (go, and the schedule's length once it has timed its first
        # steps), so every rank takes the same steps at the same lr
        left = (deadline - now) / (sum(times[2:]) / len(times[2:])) if step == PROBE_STEPS else 0.0
        going = now < deadline and step < spec.get("max_steps", 1 << 62)
        go = torch.tensor([1.0 if going else 0.0, left])
        if mode != "alone":
            dist.broadcast(go, src=lead)
        if go[0].item() == 0:
            break
        if step == PROBE_STEPS:
            total = step + int(go[1].item())
        lr = spec["lr"] * _schedule(step, warmup=inner["warmup_steps"], total=total or 10**9)
        for group in opt.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        shard = mine[(step // per_shard) % len(mine)]
        x, y = sample_batch(shard, batch_size=batch, context=context, generator=gen)
        _, loss = model(x, y)
        loss.backward()
        if mode == "ps":
            _ps_exchange(params, comm)
        if inner["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, inner["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        times.append(time.perf_counter() - t0)
        saver.after_step(step)
    saver.finish(step, times)
    if mode != "alone":
        dist.barrier()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1], int(sys.argv[2]))
    # every rank is past the last barrier: leave without tearing gloo down (its threads can abort the
    # process at exit, "terminate called without an active exception", after all the work is done)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
