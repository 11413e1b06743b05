"""deploy/: the Dockerfile, the compose file, the systemd unit and the launchd plist.

Checked for real where this machine can: the compose file and the plist are parsed, the unit goes
through `systemd-analyze verify --user` (when systemd is installed), `docker compose config`
runs when Compose is installed, `plutil -lint` on a Mac; and the commands the files run (the
coordinator configured by environment only, both health checks, create-run's shell command) run
against a real coordinator process. The rest is checked against the code: every IDLETRAIN_*
variable is a settings field, every command line parses with the real CLI, the torch pin sits
inside pyproject.toml's range, volumes match the state directories the images declare.
"""

from __future__ import annotations

import configparser
import contextlib
import fnmatch
import json
import os
import plistlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from sqlalchemy.engine import make_url

from coordinator import admin, hosts
from coordinator.settings import CoordinatorSettings
from idletrain.cli import build_parser
from idletrain.cli.operator import RUN_FLAGS, build_run_config
from idletrain.harness import free_port, wait_healthy
from shared.config import RunConfig
from tests import procs
from tests.conftest import fresh_database, postgres_reason
from worker.settings import WorkerSettings, default_state_dir

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OPERATIONS = REPO / "docs" / "operations.md"  # the deploy files' guide
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SECRETS = {"IDLETRAIN_ADMIN_TOKEN": "a" * 32, "POSTGRES_PASSWORD": "b" * 32}  # stand-ins for deploy/.env


def parse_cli(argv: list[str]):
    """The real `idletrain` parser; a usage error fails the test with argparse's message."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`idletrain {shlex.join(argv)}` does not parse (exit {exc.code})")


def coordinator_field(var: str) -> str:
    name = var.removeprefix("IDLETRAIN_").lower()
    assert var.startswith("IDLETRAIN_") and name in CoordinatorSettings.model_fields, \
        f"{var} is not a coordinator setting (coordinator/settings.py)"
    return name


def worker_field(var: str) -> str:
    name = var.removeprefix("IDLETRAIN_WORKER_").lower()
    assert var.startswith("IDLETRAIN_WORKER_") and name in WorkerSettings.model_fields, \
        f"{var} is not a worker setting (worker/settings.py)"
    return name


# -- Dockerfile ---------------------------------------------------------------------------------

@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "the Dockerfile ends inside a continuation line"
    return out


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages in order)."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for word, rest in dockerfile_instructions((DEPLOY / "Dockerfile").read_text()):
        if word == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, f"cannot read FROM {rest}"
            stages.append(Stage(base=m[1], name=m[2]))
        elif stages:
            stages[-1].instructions.append((word, rest))
        else:
            assert word == "ARG", f"only ARG may come before the first FROM, not {word}"
            key, _, default = rest.partition("=")
            global_args[key] = default
    return global_args, stages


def chain(stages: list[Stage], target: str) -> list[tuple[str, str]]:
    """Every instruction that shapes the image `target`, its base stages' first."""
    by_name = {s.name: s for s in stages if s.name}
    assert target in by_name, f"no stage `FROM … AS {target}`"
    out: list[tuple[str, str]] = []
    stage = by_name[target]
    while True:
        out = stage.instructions + out
        if stage.base not in by_name:
            return out
        stage = by_name[stage.base]


def last(instructions: list[tuple[str, str]], word: str) -> str | None:
    found = [rest for w, rest in instructions if w == word]
    return found[-1] if found else None


def env_of(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in instructions:
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def volumes_of(instructions: list[tuple[str, str]]) -> set[str]:
    out: set[str] = set()
    for word, rest in instructions:
        if word == "VOLUME":
            out |= set(json.loads(rest) if rest.startswith("[") else rest.split())
    return out


def test_dockerfile_has_both_targets_on_pinned_bases(dockerfile):
    _, stages = dockerfile
    names = {s.name for s in stages}
    assert {"coordinator", "worker"} <= names
    python_range = SpecifierSet(PYPROJECT["project"]["requires-python"])
    for stage in stages:
        if stage.base in names:
            continue
        image, _, tag = stage.base.rpartition(":")
        assert image and "/" not in tag and "$" not in stage.base, f"{stage.base}: pin a tag"
        assert tag != "latest", f"{stage.base}: no latest"
        if image == "python":
            version = re.match(r"\d+\.\d+", tag)
            assert version and Version(version[0]) in python_range, \
                f"{stage.base} is outside requires-python {python_range}"


@pytest.mark.parametrize("target", ["coordinator", "worker"])
def test_dockerfile_targets_run_as_a_non_root_user(dockerfile, target):
    instructions = chain(dockerfile[1], target)
    user = last(instructions, "USER")
    assert user, f"{target}: no USER, so it runs as root"
    uid = user.split(":")[0]
    assert uid not in ("root", "0")
    if uid.isdigit():  # the user exists in the image
        assert any(w == "RUN" and f"--uid {uid}" in r for w, r in instructions), f"no user with uid {uid}"


def test_dockerfile_installs_the_cpu_torch_pinned_inside_the_projects_range(dockerfile):
    global_args, stages = dockerfile
    runs = [rest for stage in stages for w, rest in stage.instructions if w == "RUN"]
    torch_runs = [i for i, r in enumerate(runs) if "torch==" in r]
    assert torch_runs, "torch is not installed explicitly"
    cmd = runs[torch_runs[0]]
    assert "--index-url https://download.pytorch.org/whl/cpu" in cmd
    pin = re.search(r"torch==([^\"'\s]+)", cmd)[1]
    pin = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m[1]], pin)
    (torch_req,) = [r for r in map(Requirement, PYPROJECT["project"]["dependencies"]) if r.name == "torch"]
    assert Version(pin) in torch_req.specifier, f"torch {pin} is outside pyproject.toml's {torch_req}"
    project_runs = [i for i, r in enumerate(runs) if re.search(r"pip install \"?\.\[", r)]
    assert project_runs and project_runs[0] > torch_runs[0], "the project must come after the CPU torch"


def test_dockerfile_copies_every_package_and_installs_the_server_and_postgres_extras(dockerfile):
    instructions = [i for s in dockerfile[1] for i in s.instructions]
    sources = {src.rstrip("/") for w, rest in instructions if w == "COPY" and not rest.startswith("--from")
               for src in shlex.split(rest)[:-1]}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", PYPROJECT["project"]["readme"]} <= sources
    (install,) = [r for w, r in instructions if w == "RUN" and re.search(r"pip install \"?\.\[", r)]
    extras = re.search(r"\.\[([\w,]+)\]", install)[1].split(",")
    assert {"server", "postgres"} <= set(extras)  # the coordinator image: fastapi, sqlalchemy... are the extra
    for extra in extras:
        assert extra in PYPROJECT["project"]["optional-dependencies"], f"no extra {extra!r} in pyproject.toml"
    assert any(Requirement(r).name == "psycopg" for r in PYPROJECT["project"]["optional-dependencies"]["postgres"])
    assert {"fastapi", "sqlalchemy", "alembic", "uvicorn"} <= {
        Requirement(r).name for r in PYPROJECT["project"]["optional-dependencies"]["server"]}
    # .dockerignore keeps local state and secrets out of the context, but not what the image needs.
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    for must in (".git", ".venv", "idletrain-data", "**/.env"):
        assert must in patterns
    for src in sources:
        for pat in patterns:
            base = pat[3:] if pat.startswith("**/") else None
            assert not fnmatch.fnmatch(src, pat.lstrip("/")) and not (base and fnmatch.fnmatch(src, base)), \
                f".dockerignore's {pat!r} drops {src}, which the Dockerfile copies"


def test_dockerfile_coordinator_image(dockerfile, monkeypatch, tmp_path):
    instructions = chain(dockerfile[1], "coordinator")
    env = env_of(instructions)
    settings = {coordinator_field(k): v for k, v in env.items() if k.startswith("IDLETRAIN_")}
    assert settings["host"] == "0.0.0.0"
    assert last(instructions, "EXPOSE").split() == [settings["port"]]
    assert settings["data_dir"] in volumes_of(instructions)
    healthcheck = last(instructions, "HEALTHCHECK")
    assert healthcheck and "/healthz" in healthcheck and "IDLETRAIN_PORT" in healthcheck
    argv = json.loads(last(instructions, "ENTRYPOINT")) + json.loads(last(instructions, "CMD"))
    assert argv[0] == "idletrain"
    assert parse_cli(argv[1:]).func.__name__ == "cmd_coordinator_serve"
    # Listening on 0.0.0.0 it starts without IDLETRAIN_ADMIN_TOKEN too: the operator routes then
    # require the token it generates in its data volume (there is no open mode any more), and it
    # answers any Host name, a public server's name being unknown to it.
    for var in [k for k in os.environ if k.startswith("IDLETRAIN_")]:
        monkeypatch.delenv(var)
    assert CoordinatorSettings(**settings).admin_token is None
    assert hosts.allowed_hosts(CoordinatorSettings(**settings)) is None
    given = CoordinatorSettings(**settings, admin_token=SECRETS["IDLETRAIN_ADMIN_TOKEN"])
    assert admin.ensure_token(tmp_path, given.admin_token) == (SECRETS["IDLETRAIN_ADMIN_TOKEN"], False)


def test_dockerfile_worker_image(dockerfile, capsys):
    instructions = chain(dockerfile[1], "worker")
    env = env_of(instructions)
    for var in env:
        if var.startswith("IDLETRAIN_"):
            worker_field(var)
    assert env["IDLETRAIN_WORKER_STATE_DIR"] in volumes_of(instructions)
    entrypoint = json.loads(last(instructions, "ENTRYPOINT"))
    assert entrypoint == ["idletrain", "worker", "run"]
    parse_cli(entrypoint[1:] + ["--coordinator", "https://train.example.org", "--run", "myrun"])
    with pytest.raises(SystemExit) as exc:  # no arguments: its help, not a stack trace
        build_parser().parse_args(entrypoint[1:] + json.loads(last(instructions, "CMD")))
    assert exc.value.code == 0 and "--coordinator" in capsys.readouterr().out


# -- compose.yaml -------------------------------------------------------------------------------

VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error}; `$$` is a literal `$`."""
    def one(m: re.Match) -> str:
        name, op, arg = m[1], m[2], m[3]
        if env.get(name):
            return env[name]
        if op and op.endswith("?"):
            raise KeyError(f"compose refuses to start: {arg}")
        return arg if op else ""

    return "$".join(VAR.sub(one, part) for part in value.split("$$"))


def strings(node):
    if isinstance(node, dict):
        for k, v in node.items():
            yield str(k)
            yield from strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from strings(v)
    elif isinstance(node, str):
        yield node


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    """The services with every variable filled in as compose would, from SECRETS."""
    def fill(node):
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v) for v in node]
        return interpolate(node, SECRETS) if isinstance(node, str) else node

    return fill(compose["services"])


def workers(services: dict) -> dict:
    return {k: v for k, v in services.items() if k.startswith("worker-")}


def named_volume(svc: dict, target: str) -> str:
    (source,) = [v.split(":")[0] for v in svc.get("volumes", []) if v.split(":")[1] == target]
    assert not source.startswith((".", "/")), f"{source} should be a named volume"
    return source


def test_compose_has_postgres_the_coordinator_create_run_and_two_workers(compose):
    assert {"postgres", "coordinator", "create-run"} <= set(compose["services"])
    assert sorted(workers(compose["services"])) == ["worker-1", "worker-2"]


def test_compose_variables_are_required_or_defaulted(compose):
    for s in strings(compose):
        for part in s.split("$$"):
            assert "$" not in VAR.sub("", part), f"unbraced or malformed variable in {s!r}"
            for m in VAR.finditer(part):
                assert m[2] in (":?", ":-"), f"${{{m[1]}}} in {s!r} would silently be empty when unset"


def test_compose_secrets_come_from_the_environment_only(compose):
    required = {m[1] for s in strings(compose) for m in VAR.finditer(s) if m[2] == ":?"}
    assert set(SECRETS) <= required
    for name, svc in compose["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            if re.search(r"TOKEN|PASSWORD|SECRET|JOIN_KEY", key):
                assert VAR.fullmatch(str(value)) and VAR.fullmatch(value)[2] == ":?", \
                    f"{name}: {key} must be ${{VAR:?…}}, never written in the file"
    url = compose["services"]["coordinator"]["environment"]["IDLETRAIN_DATABASE_URL"]
    assert "${POSTGRES_PASSWORD:?" in url
    # Copying .env.example without filling it in stops compose, and git ignores the real .env.
    example = dict(line.split("=", 1) for line in (DEPLOY / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert {k: v for k, v in example.items() if k in SECRETS} == {k: "" for k in SECRETS}
    for secret in SECRETS:
        with pytest.raises(KeyError, match="refuses"):
            interpolate(f"${{{secret}:?unset}}", example)
    assert ".env" in (DEPLOY / ".gitignore").read_text().split()


def test_compose_postgres(compose, services):
    pg = services["postgres"]
    image, _, tag = pg["image"].partition(":")
    assert image == "postgres" and int(tag.split("-")[0]) in (15, 16)
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    named_volume(pg, "/var/lib/postgresql/data")
    assert "ports" not in pg, "PostgreSQL is for the coordinator only"


def check_build(svc: dict, target: str, dockerfile) -> None:
    context = (DEPLOY / svc["build"]["context"]).resolve()
    assert context == REPO, "the build context must be the repository root"
    assert (context / svc["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert svc["build"]["target"] == target
    chain(dockerfile[1], target)


def test_compose_coordinator(services, dockerfile, monkeypatch):
    svc, pg = services["coordinator"], services["postgres"]
    check_build(svc, "coordinator", dockerfile)
    assert svc["depends_on"]["postgres"]["condition"] == "service_healthy"
    env = svc["environment"]
    for var in [k for k in os.environ if k.startswith("IDLETRAIN_")]:
        monkeypatch.delenv(var)
    settings = CoordinatorSettings(**{coordinator_field(k): v for k, v in env.items()})
    assert settings.host == "0.0.0.0" and settings.admin_token == SECRETS["IDLETRAIN_ADMIN_TOKEN"]
    url = make_url(settings.database_url)
    assert (url.drivername, url.host, url.port) == ("postgresql+psycopg", "postgres", 5432)
    assert (url.username, url.password, url.database) == (
        pg["environment"]["POSTGRES_USER"], SECRETS["POSTGRES_PASSWORD"], pg["environment"]["POSTGRES_DB"])
    assert named_volume(svc, str(settings.data_dir))
    (port,) = svc["ports"]
    host_side, _, container = port.rpartition(":")
    assert int(container) == settings.port
    assert host_side.startswith("127.0.0.1:"), "published on loopback unless the operator says otherwise"
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD" and f"127.0.0.1:{settings.port}/healthz" in " ".join(test)


def test_compose_create_run_makes_the_run_the_workers_join(compose, services, dockerfile):
    svc = services["create-run"]
    check_build(svc, "worker", dockerfile)
    assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert svc["restart"] == "no"
    assert svc["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = svc["command"]
    assert '"$$IDLETRAIN_ADMIN_TOKEN"' in compose["services"]["create-run"]["command"][0], \
        "the token must reach the shell from its environment, not be written into the command"
    env = svc["environment"]
    mounts = {v.split(":")[1]: (DEPLOY / v.split(":")[0]).resolve() for v in svc["volumes"]}
    show, create = [shlex.split(re.sub(r"\$(\w+)", lambda m: env[m[1]], part)) for part in script.split("||")]
    assert show[:3] == ["idletrain", "run", "show"] and create[:3] == ["idletrain", "run", "create"]
    show_args = parse_cli([a for a in show[1:] if a not in (">/dev/null", "2>&1")])
    args = parse_cli(create[1:])
    assert show_args.name == args.name == env["RUN_NAME"]
    assert args.admin_token == SECRETS["IDLETRAIN_ADMIN_TOKEN"]
    coordinator = services["coordinator"]
    for url in (show_args.coordinator, args.coordinator):
        parts = urlsplit(url)
        assert (parts.hostname, parts.port) == ("coordinator", int(coordinator["environment"]["IDLETRAIN_PORT"]))
    # The run config is the mounted deploy file plus the command's flags, and it validates.
    assert mounts[args.config].is_file()
    flags = {key: getattr(args, flag.lstrip("-").replace("-", "_")) for flag, key, _, _ in RUN_FLAGS}
    cfg = build_run_config(args.name, str(mounts[args.config]), flags)
    assert cfg.outer.group == len(workers(services))
    for name, worker in workers(services).items():
        assert parse_cli(["worker", "run", *worker["command"]]).run == args.name, f"{name} joins another run"


def test_compose_workers(services, compose, dockerfile):
    state_dir = env_of(chain(dockerfile[1], "worker"))["IDLETRAIN_WORKER_STATE_DIR"]
    coordinator = services["coordinator"]
    volumes = set()
    for svc in workers(services).values():
        check_build(svc, "worker", dockerfile)
        assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert svc["depends_on"]["create-run"]["condition"] == "service_completed_successfully"
        assert svc["restart"] in ("unless-stopped", "always", "on-failure")
        assert 0 < svc["cpu_shares"] < 1024, "below the default share: the workers yield to everything else"
        assert re.fullmatch(r"\d+m|\d+s", svc["stop_grace_period"])  # time to finish the lease
        args = parse_cli(["worker", "run", *svc["command"]])
        fields = {worker_field(k): v for k, v in svc["environment"].items()}
        settings = WorkerSettings(coordinator=args.coordinator, run=args.run, **fields)
        parts = urlsplit(settings.coordinator)
        assert (parts.scheme, parts.hostname, parts.port) == (
            "http", "coordinator", int(coordinator["environment"]["IDLETRAIN_PORT"]))
        volumes.add(named_volume(svc, state_dir))
    assert len(volumes) == len(workers(services)), "each worker needs its own state volume (its identity)"
    assert "deploy" not in compose["services"]["worker-1"], "replicas would share one state volume"


def test_compose_named_volumes_are_declared_and_used(compose):
    used = {v.split(":")[0] for svc in compose["services"].values() for v in svc.get("volumes", [])
            if not v.startswith((".", "/"))}
    assert used == set(compose["volumes"])


def test_docker_compose_config_accepts_the_file(tmp_path):
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True,
                                        check=False).returncode != 0:
        pytest.skip("docker compose is not installed here")
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in SECRETS and not k.startswith("IDLETRAIN_")}
    cmd = [docker, "compose", "--env-file", str(env_file), "-f", str(DEPLOY / "compose.yaml"), "config", "-q"]
    ok = subprocess.run(cmd, env=env | SECRETS, capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode != 0 and "IDLETRAIN_ADMIN_TOKEN" in refused.stderr + refused.stdout


# -- systemd user unit --------------------------------------------------------------------------

UNIT = DEPLOY / "systemd" / "idletrain-worker.service"


def env_file(path: Path, *, commented: bool = False) -> dict[str, str]:
    pattern = re.compile(r"^#?(\w+)=(.*)$" if commented else r"^(\w+)=(.*)$")
    return {m[1]: m[2] for line in path.read_text().splitlines() if (m := pattern.match(line.strip()))}


@pytest.fixture(scope="module")
def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",),
                                       comment_prefixes=("#", ";"), empty_lines_in_values=False)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_systemd_unit_runs_at_idle_priority_and_restarts(unit):
    svc = unit["Service"]
    assert svc["Type"] == "simple"
    assert int(svc["Nice"]) == 19
    assert svc["CPUWeight"] == "idle" or 1 <= int(svc["CPUWeight"]) <= 20
    assert svc["IOSchedulingClass"] == "idle"
    assert svc["Restart"] == "on-failure" and svc["RestartSec"]
    # Stopping: the worker's first SIGINT/SIGTERM saves its round and lets an upload finish; leave it time.
    assert svc["KillSignal"] in ("SIGINT", "SIGTERM") and svc["TimeoutStopSec"]
    assert svc["UMask"] == "0077"
    assert unit["Install"]["WantedBy"] == "default.target"


def test_systemd_unit_reads_its_settings_where_the_worker_keeps_its_state(unit, monkeypatch):
    svc = unit["Service"]
    monkeypatch.setenv("HOME", "/home/alice")
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    env_path = svc["EnvironmentFile"].lstrip("-")
    assert Path(env_path.replace("%h", "/home/alice")).parent == default_state_dir()
    example = env_file(DEPLOY / "systemd" / "worker.env.example")
    for var in env_file(DEPLOY / "systemd" / "worker.env.example", commented=True):
        worker_field(var)
    argv = shlex.split(svc["ExecStart"])
    assert argv[0].startswith("%h/") and argv[0].endswith("/bin/idletrain")
    used = {m[1] for a in argv for m in re.finditer(r"\$\{(\w+)\}", a)}
    assert used <= set(example), f"ExecStart uses {used - set(example)}, which worker.env.example lacks"
    args = parse_cli([re.sub(r"\$\{(\w+)\}", lambda m: example[m[1]], a) for a in argv[1:]])
    assert args.func.__name__ == "cmd_worker_run"
    WorkerSettings(coordinator=args.coordinator, run=args.run,
                   **{worker_field(k): v for k, v in example.items() if k not in used})


def systemd_version(exe: str) -> int:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    return int(re.match(r"systemd (\d+)", out)[1])


def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed here")
    # The unit as it is; %h is $HOME, where an idletrain and a worker.env stand ready.
    home, runtime, units = tmp_path / "home", tmp_path / "run", tmp_path / "units"
    binary = home / ".local/share/idletrain/venv/bin/idletrain"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    (home / ".config/idletrain").mkdir(parents=True)
    shutil.copy(DEPLOY / "systemd" / "worker.env.example", home / ".config/idletrain/worker.env")
    runtime.mkdir(mode=0o700)
    units.mkdir()
    shutil.copy(UNIT, units / UNIT.name)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime),
           "SYSTEMD_LOG_COLOR": "0"}
    res = subprocess.run([exe, "verify", "--user", "--man=no", str(units / UNIT.name)], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    out = (res.stdout + res.stderr).strip()
    if "Failed to initialize manager" in out:
        pytest.skip(f"systemd-analyze cannot start a user manager here: {out}")
    # The restart backoff keys came in systemd 254; older ones ignore them with this warning.
    known = [] if systemd_version(exe) >= 254 else [
        re.compile(r".*: Unknown key (name )?'(RestartSteps|RestartMaxDelaySec)' in section \[Service\], ignoring\.")]
    unexpected = [line for line in out.splitlines() if line and not any(k.fullmatch(line) for k in known)]
    assert res.returncode == 0 and not unexpected, out


# -- launchd plist ------------------------------------------------------------------------------

PLIST = DEPLOY / "launchd" / "org.idletrain.worker.plist"
MAC = {"__HOME__": "/Users/alice", "__COORDINATOR__": "https://train.example.org", "__RUN__": "myrun"}


def test_plist_is_well_formed_with_the_keys_launchd_needs():
    plist = plistlib.loads(PLIST.read_bytes())  # expat: malformed XML raises
    assert plist["Label"] == PLIST.stem
    assert isinstance(plist["ProgramArguments"], list) and all(isinstance(a, str) for a in plist["ProgramArguments"])
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}, "restart after failures, not after a clean stop"
    assert plist["ProcessType"] == "Background"
    assert plist["LowPriorityIO"] is True
    assert plist["Nice"] == 19
    for key in ("ThrottleInterval", "ExitTimeOut", "Umask"):
        assert type(plist[key]) is int
    assert plist["Umask"] == 0o077
    env = plist["EnvironmentVariables"]
    assert isinstance(env, dict) and all(isinstance(v, str) for v in env.values())
    for var in env:
        if var.startswith("IDLETRAIN_"):
            worker_field(var)


def test_plist_once_installed_runs_the_worker_with_absolute_paths():
    text = PLIST.read_text()
    assert set(re.findall(r"__[A-Z]+__", text)) == set(MAC)
    guide = OPERATIONS.read_text()
    for placeholder in MAC:
        assert f"s|{placeholder}|" in guide, f"docs/operations.md's sed does not fill in {placeholder}"
    for placeholder, value in MAC.items():
        text = text.replace(placeholder, value)
    plist = plistlib.loads(text.encode())
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert plist[key].startswith("/Users/alice/Library/Logs/")
    argv = plist["ProgramArguments"]
    assert Path(argv[0]).is_absolute()
    # The same virtualenv as the systemd unit's.
    assert argv[0] == shlex.split(unit_exec_start())[0].replace("%h", "/Users/alice")
    args = parse_cli(argv[1:])
    assert args.func.__name__ == "cmd_worker_run"
    WorkerSettings(coordinator=args.coordinator, run=args.run,
                   **{worker_field(k): v for k, v in plist["EnvironmentVariables"].items()
                      if k.startswith("IDLETRAIN_")})


def unit_exec_start() -> str:
    (line,) = [x for x in UNIT.read_text().splitlines() if x.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


def test_plutil_lint_accepts_the_plist():
    plutil = shutil.which("plutil")
    if plutil is None:
        pytest.skip("plutil (macOS) is not installed here")
    res = subprocess.run([plutil, "-lint", str(PLIST)], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


# -- docs/operations.md, the deploy files' guide --------------------------------------------------

def test_operations_guide_names_every_deploy_file_and_only_existing_ones():
    guide = OPERATIONS.read_text()
    for path in DEPLOY.rglob("*"):
        rel = path.relative_to(DEPLOY).as_posix()
        if path.is_file() and rel not in ("README.md", ".gitignore", ".env"):
            assert f"`{rel}`" in guide or f"deploy/{rel}" in guide, f"docs/operations.md does not mention {rel}"
    for rel in re.findall(r"(?<![\w/])deploy/[\w./-]*\w", guide):
        assert (REPO / rel).exists() or rel == "deploy/.env", f"docs/operations.md names {rel}, which does not exist"


# -- the commands, run -------------------------------------------------------------------------

@pytest.mark.slow
def test_compose_commands_work_against_a_real_coordinator(compose, services, dockerfile, corpus_dir, tmp_path):
    """The coordinator configured by the compose file's environment alone (its processes on a fresh
    PostgreSQL schema here, or one process on SQLite when PostgreSQL cannot be reached; loopback,
    a free port: no Docker here), the image's and the compose file's health checks, and
    create-run's shell command, run twice."""
    with contextlib.ExitStack() as stack:
        db_url = None if postgres_reason() else stack.enter_context(fresh_database("postgresql"))
        _compose_against_a_real_coordinator(services, dockerfile, corpus_dir, tmp_path, db_url)


def _compose_against_a_real_coordinator(services, dockerfile, corpus_dir, tmp_path, db_url: str | None):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "idletrain").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m idletrain "$@"\n')
    (bin_dir / "idletrain").chmod(0o755)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("IDLETRAIN_") and k not in SECRETS}
    base.update(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=str(REPO),
                OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    coord_env = dict(services["coordinator"]["environment"])
    if db_url is None:  # SQLite in the data dir, one process; the URL's form is checked above
        del coord_env["IDLETRAIN_DATABASE_URL"], coord_env["IDLETRAIN_PROCESSES"]
    else:
        coord_env["IDLETRAIN_DATABASE_URL"] = db_url
    coord_env.update(IDLETRAIN_HOST="127.0.0.1", IDLETRAIN_PORT=str(port), IDLETRAIN_DATA_DIR=str(tmp_path / "data"),
                     IDLETRAIN_CORPUS_DIRS=str(corpus_dir))  # the tiny corpus below in place of the built-in one
    healthcheck = last(chain(dockerfile[1], "coordinator"), "HEALTHCHECK")
    probe = ["/bin/sh", "-c", re.match(r"(--\S+\s+)*CMD\s+(.*)", healthcheck)[2]]
    compose_probe = [a.replace(":8000/", f":{port}/") for a in services["coordinator"]["healthcheck"]["test"][1:]]

    def health(argv: list[str]) -> int:
        return subprocess.run(argv, env=base | {"IDLETRAIN_PORT": str(port)}, capture_output=True,
                              timeout=60, check=False).returncode

    assert health(probe) != 0, "the health check passes with no coordinator"
    with open(tmp_path / "coordinator.log", "w") as log:
        proc = procs.popen([sys.executable, "-m", "idletrain", "--log-level", "WARNING", "coordinator", "serve"],
                                env=base | coord_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        try:
            with httpx.Client(base_url=url, timeout=120) as client:
                try:
                    wait_healthy(client, proc, timeout_s=120)
                except RuntimeError as exc:
                    pytest.fail(f"{exc}:\n{(tmp_path / 'coordinator.log').read_text()[-3000:]}")
                assert health(probe) == 0 and health(compose_probe) == 0
                # create-run, with the tiny corpus in place of the mounted config: makes the run, then,
                # run again, finds it and exits 0.
                config = tmp_path / "run.toml"
                config.write_text(f'corpus = "{corpus_dir}"\ncorpus_max_bytes = 262144\nshard_tokens = 8192\n'
                                  'eval_tokens = 4096\n[model]\nn_layer = 1\nn_head = 2\nd_model = 32\ncontext = 32\n'
                                  '[inner]\nsteps = 3\nbatch_size = 4\n')
                svc = services["create-run"]
                script = (svc["command"][0].replace("http://coordinator:8000", url)
                          .replace("/etc/idletrain/run.toml", str(config)))
                run_env = base | svc["environment"]
                for attempt in ("creates", "finds"):
                    res = subprocess.run([*svc["entrypoint"], script], env=run_env, capture_output=True, text=True,
                                         timeout=300, check=False)
                    assert res.returncode == 0, f"create-run {attempt}: {res.stdout}{res.stderr}"
                runs = client.get("/api/v1/runs").json()
                assert [r["name"] for r in runs] == [svc["environment"]["RUN_NAME"]]
                cfg = client.get(f"/api/v1/runs/{runs[0]['name']}/config").json()
                assert cfg["outer"]["group"] == len(workers(services))
        finally:
            procs.stop(proc, signal.SIGINT)


# -- deploy/run.example.toml ---------------------------------------------------------------------

def test_run_example_is_a_valid_run_that_keeps_the_recommended_algorithm():
    """The example sizes a run (model, shards, group) but does not undo the defaults that were chosen
    by measurement: compression and the outer rule stay what RunConfig recommends."""
    cfg = build_run_config("example", str(DEPLOY / "run.example.toml"), {})
    defaults = RunConfig(name="example")
    assert cfg.compression == defaults.compression, cfg.compression
    assert cfg.outer.model_copy(update={"group": defaults.outer.group}) == defaults.outer, cfg.outer
    assert cfg.algorithm == defaults.algorithm


def test_run_long_is_the_long_run_configuration_the_benchmark_measured():
    """deploy/run.long.toml sets what the long profile measured as its long-run configuration
    (bench/convergence_long.py's long_run_method): the file and the measured row cannot drift apart."""
    from bench.convergence_long import long_run_method
    from bench.sim import Method
    from shared import protocol

    cfg = build_run_config("long", str(DEPLOY / "run.long.toml"), {})
    row = long_run_method(Method("default", "diloco"), workers=cfg.outer.group)
    assert cfg.inner.steps == row.H
    assert cfg.inner.second_moment_workers == row.second_moment_workers == cfg.outer.group
    assert cfg.compression == row.compression
    assert (cfg.update_values, cfg.update_feedback, row.down) == (row.update_values, True, "feedback")
    assert (cfg.outer.lr, cfg.outer.momentum) == (row.outer.lr, row.outer.momentum)
    # the same model and batch as the example, at the inner lr factor the benchmark measured against plain AdamW's
    example = build_run_config("example", str(DEPLOY / "run.example.toml"), {})
    assert (cfg.model, cfg.inner.batch_size) == (example.model, example.inner.batch_size)
    assert cfg.inner.lr == pytest.approx(example.inner.lr * row.inner_lr_factor) and row.inner_lr_factor < 1
    assert protocol.lease_api_version(cfg) == protocol.API_VERSION == 4
