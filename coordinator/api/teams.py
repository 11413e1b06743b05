"""Registered teams: the operator's create / list / delete (TeamService)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from coordinator.api.deps import AdminDep, CoordinatorDep
from shared import protocol

router = APIRouter(prefix=protocol.API_PREFIX, tags=["teams"])


@router.post("/teams", status_code=201, response_model=protocol.TeamInfo)
async def create_team(req: protocol.TeamCreate, coord: CoordinatorDep, _: AdminDep) -> protocol.TeamInfo:
    """Register a team: its name is then taken only with its key, which this answer shows, once
    (operators)."""
    return await run_in_threadpool(coord.teams.create, req)


@router.get("/teams", response_model=list[protocol.TeamInfo])
async def list_teams(coord: CoordinatorDep, _: AdminDep) -> list[protocol.TeamInfo]:
    """Every registered team, its cap per address and verified members (operators)."""
    return await run_in_threadpool(coord.teams.list)


@router.delete("/teams/{team}", response_model=protocol.TeamInfo)
async def delete_team(team: str, coord: CoordinatorDep, _: AdminDep) -> protocol.TeamInfo:
    """Delete a registered team: its members keep working, under its name as a label, unverified
    (operators)."""
    return await run_in_threadpool(coord.teams.delete, team)
