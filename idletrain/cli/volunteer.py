"""The volunteer's commands: `idletrain worker run` (train for a run until Ctrl-C) and the local
control of a running worker, `idletrain worker pause|resume|status`, through files in its state
dir, never over the network."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import httpx
from pydantic import ValidationError

from idletrain.cli.common import fail, log

WORKER_FLAGS = ["coordinator", "run", "token", "device", "threads", "state_dir", "name", "team", "contributor_key",
                "team_key", "join_key", "max_rounds", "max_params", "micro_batch", "precision", "activation_checkpointing",
                "checkpoint_every_steps", "when", "idle_minutes", "on_battery",
                "max_other_load", "max_upload_kbps", "max_download_kbps", "daily_transfer_mb", "hours",
                "max_memory", "keep_awake"]


def on_terminal() -> bool:
    """A person at the keyboard: stdin and stdout both a TTY (a service, a pipe or a test has neither)."""
    return sys.stdin.isatty() and sys.stdout.isatty()


def first_run(args: argparse.Namespace, *, tty: Callable[[], bool] | None = None,
              read: Callable[[str], str] | None = None, write: Callable[[str], None] = print) -> None:
    """On a terminal (`tty`, default on_terminal), with `when` set nowhere: ask always-or-idle once
    (`read`, default input) and save it (worker/firstrun.py). The answer also goes into args.when, so
    it holds even when the file cannot be written."""
    from worker import firstrun
    from worker.settings import ENV_PREFIX, config_file, default_config_file

    path = config_file(args.config)  # ValueError: the --config file is missing (the caller says so)
    if not (tty or on_terminal)() or firstrun.policy_chosen(args.when, os.environ, path, prefix=ENV_PREFIX):
        return
    target = path or default_config_file()
    args.when = firstrun.ask_when(read or input, write)
    try:
        firstrun.save_when(target, args.when)
    except OSError as exc:
        write(f"Could not save the answer in {target} ({exc}); pass --when {args.when} next time.")
        return
    write(f'Saved `when = "{args.when}"` in {target}: edit it there, or pass --when always|idle, to change it.')


def cmd_worker_run(args: argparse.Namespace) -> int:
    from worker.loop import run_worker
    from worker.settings import describe_errors, load_settings

    try:  # flags > IDLETRAIN_WORKER_* > worker.toml > defaults
        first_run(args)
        settings = load_settings({k: getattr(args, k) for k in WORKER_FLAGS}, config=args.config)
    except ValidationError as exc:
        return fail(describe_errors(exc))
    except ValueError as exc:
        return fail(str(exc))
    try:
        rounds = run_worker(settings)
    except KeyboardInterrupt:
        log.warning("interrupted")
        return 130
    except httpx.TransportError as exc:
        return fail(f"cannot reach the coordinator at {settings.coordinator} ({exc}); is it running?")
    except RuntimeError as exc:
        return fail(str(exc))
    except Exception as exc:
        from worker.client import CoordinatorError
        if isinstance(exc, CoordinatorError):
            return fail(f"coordinator said {exc.status}: {exc.detail}")
        raise
    if rounds is None:
        log.info("worker done (a follower rank of a torchrun worker: rank 0 delivers the rounds)")
    else:
        log.info("worker done: %d rounds delivered", rounds)
    return 0


def cmd_worker_local(args: argparse.Namespace) -> int:
    """`idletrain worker pause|resume|status`: the running worker's control and status files (no network)."""
    from worker.control import ControlFile, StatusFile, is_live, run_folders
    from worker.progress import describe
    from worker.settings import resolve_state_dir

    try:
        state_dir = resolve_state_dir(args.state_dir, config=args.config)
    except ValueError as exc:
        return fail(str(exc))
    folders = run_folders(state_dir, coordinator=args.coordinator, run=args.run)
    if not folders:
        return fail(f"no worker has run under {state_dir}" + (f" for run {args.run!r}" if args.run else "")
                     + "; pass --state-dir, or --coordinator and --run")
    if args.action == "status":
        found = [(folder, StatusFile(folder).read()) for folder in folders]
        if args.json:
            print(json.dumps([{**vars(st), "live": is_live(st)} for _, st in found if st is not None], indent=2))
            return 0
        for folder, st in found:
            if st is None:
                print(f"{folder}: no worker has reported here yet")
                continue
            alive = "" if is_live(st) else f" [not running; last report {st.updated_at}]"
            print(f"run {st.run} at {st.coordinator} (pid {st.pid}){alive}\n  {describe(st)}")
        return 0
    paused = args.action == "pause"
    for folder in folders:
        ControlFile(folder).request(paused=paused)
        st = StatusFile(folder).read()
        who = f"run {st.run} at {st.coordinator}" if st is not None else str(folder)
        running = st is not None and is_live(st)
        print(f"{who}: {'paused' if paused else 'resumed'}"
              + ("" if running else " (no worker running now; it applies when one starts)"))
    return 0


def _name_options(wrun) -> None:
    """`worker run`'s name, team and their keys."""
    wrun.add_argument("--name", default=None, help="contributor name for the leaderboard")
    wrun.add_argument("--team", default=None, help="team name for the leaderboard (a team the operator registered "
                                                   "needs its --team-key)")
    wrun.add_argument("--team-key", default=None, metavar="KEY",
                      help="join --team as a verified member: the key the operator created the team with")
    wrun.add_argument("--contributor-key", default=None, metavar="KEY",
                      help="add this machine under --name, which your first machine claimed: the key that first "
                           "registration printed")


def register(sub):
    """`idletrain worker run|pause|resume|status`; the `worker` subcommands, for the operator's to join."""
    wk = sub.add_parser("worker", help="run a worker").add_subparsers(dest="action", required=True)
    wrun = wk.add_parser("run", help="train for a run until Ctrl-C (once: finish the lease; twice: now)",
                         description="Every option may also come from IDLETRAIN_WORKER_<OPTION> or from "
                                     "~/.config/idletrain/worker.toml (option = value, with underscores); "
                                     "flags win over the environment, which wins over the file.")
    wrun.add_argument("--config", default=None,
                      help="TOML file of worker settings (default ~/.config/idletrain/worker.toml, if it exists)")
    wrun.add_argument("--coordinator", default=None, help="coordinator base URL (required here, in the environment "
                                                          "or in the config file)")
    wrun.add_argument("--run", default=None, help="the run to train; without it (or with auto) the worker follows the "
                                                  "coordinator: its active run of highest priority this machine can "
                                                  "hold, the next one when that one finishes")
    wrun.add_argument("--token", default=None, help="worker token (default: register once, then reuse)")
    wrun.add_argument("--join-key", default=None)
    wrun.add_argument("--device", default=None, choices=["auto", "cpu", "cuda", "mps"])
    wrun.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    wrun.add_argument("--state-dir", default=None, help="token and cache (default ~/.config/idletrain)")
    _name_options(wrun)
    wrun.add_argument("--max-rounds", type=int, default=None, help="stop after N delivered rounds")
    wrun.add_argument("--max-params", type=int, default=None,
                      help="refuse runs whose model is larger (default: what this machine's available "
                           "memory holds for training)")
    wrun.add_argument("--micro-batch", type=int, default=None, metavar="N",
                      help="the most sequences per forward/backward pass: a step's batch goes in micro-batches "
                           "whose gradients add up to the same step (default: the run's, split further when this "
                           "machine's memory budget needs it)")
    wrun.add_argument("--precision", default=None, choices=["auto", "fp32", "bf16"],
                      help="auto (default): bf16 autocast on CUDA and MPS that compute bf16, fp32 on CPU; "
                           "weights, optimizer state and deltas stay fp32")
    wrun.add_argument("--activation-checkpointing", action="store_true", default=None,
                      help="recompute each block's activations in the backward pass: less memory, ~1/3 more compute")
    wrun.add_argument("--checkpoint-every-steps", type=int, default=None,
                      help="save the round in flight every N local steps so a kill resumes it (default 25; 0: "
                           "only at round end)")
    wrun.add_argument("--when", default=None, choices=["always", "idle"],
                      help="train always, or only while nobody uses the machine (default: asked once on a "
                           "terminal and saved in worker.toml; always where nobody is asked, as under a service)")
    wrun.add_argument("--idle-minutes", type=float, default=None,
                      help="with --when idle: minutes without input (or CPU load) before training (default 5)")
    wrun.add_argument("--on-battery", default=None, choices=["pause", "run"],
                      help="on battery power (default: pause with --when idle, run with --when always)")
    wrun.add_argument("--max-other-load", type=float, default=None,
                      help="with --when idle where input idle time is unknown: busy while other processes use "
                           "more than this share of the CPUs (default 0.3)")
    wrun.add_argument("--max-upload-kbps", type=float, default=None, help="upload limit in kilobits/s")
    wrun.add_argument("--max-download-kbps", type=float, default=None, help="download limit in kilobits/s")
    wrun.add_argument("--daily-transfer-mb", type=float, default=None,
                      help="MB sent + received per UTC day (kept across restarts); when reached, pause until "
                           "00:00 UTC")
    wrun.add_argument("--hours", default=None, metavar="WINDOWS",
                      help='train only in these local hours: "22:00-07:00", or with days "mon-fri 19:00-08:00, '
                           'sat-sun 00:00-24:00" (a window belongs to the day it starts on); a round in progress '
                           "pauses when they end")
    wrun.add_argument("--max-memory", default=None, metavar="SIZE",
                      help="the most memory a round may take (6GB, 8GiB; at least 1GiB): larger leases are "
                           "refused, micro-batches made to fit (default: from this machine's available memory)")
    wrun.add_argument("--keep-awake", action="store_true", default=None,
                      help="hold off the machine's sleep while a round runs (caffeinate on macOS, systemd-inhibit "
                           "on Linux, SetThreadExecutionState on Windows)")
    wrun.set_defaults(func=cmd_worker_run)
    for action, hlp in (("pause", "pause the worker(s) on this machine at the next local step (saved first)"),
                        ("resume", "let paused worker(s) on this machine go on"),
                        ("status", "what the worker(s) on this machine are doing")):
        sp = wk.add_parser(action, help=hlp, description=hlp + ". Talks to the running worker through files in "
                                                               "its state dir, never over the network.")
        sp.add_argument("--state-dir", default=None, help="the worker's state dir (default: as `worker run`)")
        sp.add_argument("--config", default=None, help="worker.toml to take the state dir from")
        sp.add_argument("--coordinator", default=None, help="only the worker of this coordinator ...")
        sp.add_argument("--run", default=None, help="... and/or of this run (default: every worker under the "
                                                    "state dir)")
        if action == "status":
            sp.add_argument("--json", action="store_true")
        sp.set_defaults(func=cmd_worker_local)
    return wk
