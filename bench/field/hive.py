"""The field's hivemind row, one process per peer (`python -m bench.field.hive SPEC.json RANK`), run with
the Python of a venv that holds hivemind (its pins are its own: `bench field --hivemind-python`).

hivemind (Ryabinin et al., the public volunteer-training library) as its docs set it up for
volunteers: a DHT over its p2p daemon (peer 0 first, the others join it), and `hivemind.Optimizer`
with `use_local_updates=True`: every peer takes a local AdamW step on each batch and the peers
average their parameters (fp16 on the wire, in the background) each time the collaboration has
trained `target_batch_size` samples between them: the same samples between averagings as an
idletrain run's outer group (workers x H x batch). The same model, data, batches, lr schedule,
CPU cap and links as the other rows; peer 0 saves the model every `save_every_s` seconds for the
driver to evaluate afterwards, as bench.field.ddp does.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

from bench.field.data import staged_shards
from bench.field.ddp import Saver, _schedule
from shared.data import sample_batch
from shared.model import ModelConfig, build_model


def main(spec_path: str, rank: int) -> int:
    import hivemind
    from hivemind.compression import Float16Compression

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    out, started = Path(spec["out"]), spec["started"]
    deadline = started + spec["duration_s"]
    addr = spec["addrs"][rank]
    peers_file = out / "peers.json"
    maddr = f"/ip4/{addr}/tcp/{spec['port']}"
    if rank == 0:
        dht = hivemind.DHT(host_maddrs=[maddr], start=True)
        tmp = peers_file.with_suffix(".tmp")
        tmp.write_text(json.dumps([str(m) for m in dht.get_visible_maddrs()]))
        tmp.rename(peers_file)
    else:
        while not peers_file.exists():
            if time.time() > deadline:
                raise SystemExit("peer 0 never published its address")
            time.sleep(0.2)
        dht = hivemind.DHT(initial_peers=json.loads(peers_file.read_text()), host_maddrs=[maddr], start=True)
    cfg = ModelConfig.from_dict(spec["model"])
    model = build_model(cfg, seed=spec["model_seed"])
    inner = spec["inner"]
    batch, context = inner["batch_size"], cfg.context
    opt = hivemind.Optimizer(
        dht=dht, run_id=f"field{spec['seed']}_lr{round(spec['lr'] * 1e6)}", target_batch_size=spec["target_batch_size"],
        batch_size_per_step=batch, params=model.parameters(),
        optimizer=partial(torch.optim.AdamW, lr=spec["lr"], betas=(0.9, 0.95), weight_decay=inner["weight_decay"]),
        use_local_updates=True, matchmaking_time=spec.get("matchmaking_time", 3.0),
        averaging_timeout=spec.get("averaging_timeout", 30.0),
        state_averaging_compression=Float16Compression(), verbose=False)
    shards = staged_shards(spec["shards"])
    mine = shards[rank::spec["workers"]]
    gen = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    per_shard = max(1, mine[0].numel() // (batch * context))
    step, times, total = 0, [], None
    saver = Saver(out, model, lead=rank == 0, started=started, every=spec["save_every_s"],
                  tokens_per_step=batch * context * spec["workers"])
    saver.save(0, time.time(), epochs=0)
    while time.time() < deadline:
        if step == 12:  # as the ddp ranks do: the cosine's length from the first steps' pace
            total = step + int((deadline - time.time()) / (sum(times[2:]) / len(times[2:])))
        lr = spec["lr"] * _schedule(step, warmup=inner["warmup_steps"], total=total or 10**9)
        for group in opt.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        x, y = sample_batch(mine[(step // per_shard) % len(mine)], batch_size=batch, context=context, generator=gen)
        _, loss = model(x, y)
        loss.backward()
        if inner["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), inner["grad_clip"])
        opt.step()
        opt.zero_grad()
        step += 1
        times.append(time.perf_counter() - t0)
        saver.after_step(step, epochs=opt.local_epoch)
    saver.finish(step, times, epochs=opt.local_epoch)
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1], int(sys.argv[2]))
    except BaseException:  # hivemind's threads would keep a failed peer alive: say why, then go
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # hivemind's daemon and threads are not waited for: the row is over
