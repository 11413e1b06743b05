"""Teams: the operator's registered teams (create, list, delete) and a registration's team.

A team is a label a worker declares (`--team`), shared and never unique, until the operator
registers its name with a key (`idletrain team create`, the key shown once and stored hashed).
From then on the name, compared as contributor names are (coordinator/names.py: a lookalike of
it too), is taken only with the key: such a worker is a verified member (workers.team_id), whose
live leases count against the team's own cap per address instead of max_leases_per_address. A
label no team registered keeps working as before."""

from __future__ import annotations

import logging
import secrets

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from coordinator import names
from coordinator.db import Database
from coordinator.errors import Conflict, Forbidden, NotFound, Unprocessable
from coordinator.queries import teams as team_rows
from coordinator.services.common import aware, hash_secret
from shared import protocol

log = logging.getLogger(__name__)


def team_of(c: Connection, team: str | None, key: str | None) -> tuple[str | None, int | None]:
    """(the label a registering worker shows, its registered team's id or None) for its `team` (as
    cleaned) and team `key`: a registered team's name (or a lookalike) needs its key (409 without,
    403 wrong), and shows as registered; a key for no registered team is refused (422)."""
    if team is None:
        if key is not None:
            raise Unprocessable("a team key (--team-key) needs the team's name (--team NAME)")
        return None, None
    try:
        registered = team_rows.matching(c, names.name_keys(team))
    except ValueError as exc:
        raise Unprocessable(f"team: {exc}") from None
    if registered is None:
        if key is not None:
            raise Unprocessable(f"no team named {team!r} is registered on this coordinator, so --team-key has "
                                "nothing to join; check the name with the operator (`idletrain team list`)")
        return team, None
    if key is None:
        shown = "" if registered.name == team else f" (as {registered.name!r}: names are compared ignoring case, " \
                                                   "width, accents, invisible characters and lookalike letters)"
        raise Conflict(f"the team {team!r} is registered on this coordinator{shown}: join it with its key "
                       "(--team-key KEY, from the team's operator), or choose another team name")
    if not secrets.compare_digest(hash_secret(key), registered.key_hash):
        raise Forbidden(f"wrong team key for the team {registered.name!r}")
    return registered.name, registered.id


def _info(row, key: str | None = None) -> protocol.TeamInfo:
    team_id, name, cap, created_at, members = row
    return protocol.TeamInfo(team_id=team_id, name=name, max_leases_per_address=cap, created_at=aware(created_at),
                             members=members, key=key)


class TeamService:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, req: protocol.TeamCreate) -> protocol.TeamInfo:
        """Register a team; the answer holds its key, the only time it is shown. 409 for a name (or a
        lookalike of one) already registered, 422 for a name that cannot be shown as plain text."""
        try:
            name = names.clean(req.name, what="team")
            keys = names.name_keys(name or "")
        except ValueError as exc:
            raise Unprocessable(str(exc)) from None
        key = secrets.token_urlsafe(24)
        try:
            with self.db.begin() as c:
                taken = team_rows.matching(c, keys)
                if taken is not None:
                    raise Conflict(f"the team {taken.name!r} is registered already" + (
                        "" if taken.name == name else f", and {name!r} looks like it") + ": choose another name")
                team_id = team_rows.insert_team(c, name=name, keys=keys, key_hash=hash_secret(key),
                                                max_leases_per_address=req.max_leases_per_address)
                row = next(r for r in team_rows.listed(c) if r[0] == team_id)
        except IntegrityError:  # created at the same moment by another operator command
            raise Conflict(f"the team {name!r} is registered already: choose another name") from None
        log.warning("team %r registered by the operator (cap per address: %s)", name,
                    req.max_leases_per_address or "the coordinator's")
        return _info(row, key)

    def list(self) -> list[protocol.TeamInfo]:
        with self.db.read() as c:
            return [_info(row) for row in team_rows.listed(c)]

    def delete(self, name: str) -> protocol.TeamInfo:
        """Delete a registered team: its members keep their token and its name as a label, no longer
        verified (their leases count against max_leases_per_address again), and the name is free."""
        with self.db.begin() as c:
            found = next((row for row in team_rows.listed(c) if row[1] == name), None)
            if found is None:
                raise NotFound(f"no team named {name!r} is registered (`idletrain team list`)")
            team_rows.remove(c, found[0])
        log.warning("team %r deleted by the operator; its %d member(s) are no longer verified", name, found[4])
        return _info(found)
