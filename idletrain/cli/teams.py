"""`idletrain team create|list|delete`: the teams the operator registers on a running coordinator.
A registered team's name is taken only with its key (shown once, at `create`); its verified members'
live leases from one address count against its own cap (--max-leases-per-address), apart from the
coordinator's max_leases_per_address for everyone else there: a lab behind one NAT address."""

from __future__ import annotations

import argparse
import json
from urllib.parse import quote

from idletrain.cli.client import OperatorClient
from idletrain.cli.common import ADMIN_TOKEN_HELP, DATA_DIR_HELP, DEFAULT_COORDINATOR


def _cap(team: dict) -> str:
    return str(team["max_leases_per_address"]) if team["max_leases_per_address"] else "the coordinator's"


def cmd_team_create(args: argparse.Namespace) -> int:
    rc, team = OperatorClient(args).call("POST", "/teams", admin=True, json={
        "name": args.name, "max_leases_per_address": args.max_leases_per_address})
    if rc:
        return rc
    print(f"team {team['name']!r} registered (live leases per address: {_cap(team)})\n"
          f"team key (shown once; the coordinator keeps only its hash): {team['key']}\n"
          f"its members register with: idletrain worker run --team {json.dumps(team['name'])} --team-key KEY "
          "(or team_key in worker.toml)")
    return 0


def cmd_team_list(args: argparse.Namespace) -> int:
    rc, teams = OperatorClient(args).call("GET", "/teams", admin=True)
    if rc:
        return rc
    if args.json:
        print(json.dumps(teams, indent=2))
        return 0
    print(f"{'name':<24} {'members':>7}  {'leases per address':<20} created")
    for t in teams:
        print(f"{t['name'][:24]:<24} {t['members']:>7}  {_cap(t):<20} {t['created_at']}")
    return 0


def cmd_team_delete(args: argparse.Namespace) -> int:
    rc, team = OperatorClient(args).call("DELETE", f"/teams/{quote(args.name, safe='')}", admin=True)
    if rc:
        return rc
    print(f"team {team['name']!r} deleted: its {team['members']} member(s) keep working under the name as a "
          "plain label, no longer verified")
    return 0


def register(sub) -> None:
    team = sub.add_parser("team", help="teams with a key: verified members, their own lease cap per address "
                                       "(operators)").add_subparsers(dest="action", required=True)
    create = team.add_parser("create", help="register a team; prints its key once")
    create.add_argument("name")
    create.add_argument("--max-leases-per-address", type=int, default=None, metavar="N",
                        help="live leases of a run its members may hold from one address (default: the "
                             "coordinator's max_leases_per_address, counted apart from other workers')")
    create.set_defaults(func=cmd_team_create)
    tlist = team.add_parser("list", help="registered teams, their members and caps")
    tlist.add_argument("--json", action="store_true")
    tlist.set_defaults(func=cmd_team_list)
    delete = team.add_parser("delete", help="delete a team: its members stay, unverified")
    delete.add_argument("name")
    delete.set_defaults(func=cmd_team_delete)
    for sp in (create, tlist, delete):
        sp.add_argument("--coordinator", default=DEFAULT_COORDINATOR)
        sp.add_argument("--admin-token", default=None, help=ADMIN_TOKEN_HELP)
        sp.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
