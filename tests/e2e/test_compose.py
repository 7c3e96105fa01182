"""The deployment files (docker-compose.yml, docker/*.Dockerfile) against the code they run.

No Docker daemon is needed: every ``foldwise ...`` command named by a compose service or a
Dockerfile's CMD/ENTRYPOINT must parse with our own CLI parser (a renamed flag breaks the
deployment, and this test), paths the builds copy must exist, and the compose wiring is checked:
postgres healthy -> migrate completed -> api and worker, the worker reserving a GPU.
PyYAML comes with optuna (a dependency).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml

from service.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
# what an operator would set; unset variables take the defaults written in the files
SAMPLE_ENV = {"FOLDWISE_DB_URL": "postgresql+psycopg://foldwise:pw@postgres:5432/foldwise", "FOLDWISE_TARGET": "h100"}

_VAR = re.compile(r"\$(?:\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?])?(?P<arg>[^}]*)\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose/sh-style ``${VAR}``, ``${VAR:-default}``, ``${VAR:?message}``, ``$VAR``."""

    def sub(m: re.Match) -> str:
        name = m.group("name") or m.group("bare")
        op, arg = m.group("op"), m.group("arg")
        if env.get(name):
            return env[name]
        if op in (":-", "-"):
            return arg
        raise AssertionError(f"${{{name}}} is not set and has no default (in {text!r})")

    return _VAR.sub(sub, text)


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def command_argv(value: str | list[str], env: dict[str, str]) -> list[str]:
    """A command as argv: exec form as is, ``sh -c SCRIPT`` or a shell string split like sh would."""
    argv = [interpolate(a, env) for a in value] if isinstance(value, list) else shlex.split(interpolate(value, env))
    if len(argv) >= 3 and Path(argv[0]).name in ("sh", "bash") and argv[1] == "-c":
        argv = shlex.split(argv[2])
    if argv[:1] == ["exec"]:
        argv = argv[1:]
    return argv


def foldwise_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every foldwise command in the compose file and the Dockerfiles."""
    found = []
    for name, service in load_compose()["services"].items():
        for key in ("entrypoint", "command"):
            if key in service:
                found.append((f"docker-compose.yml services.{name}.{key}", command_argv(service[key], {})))
    for path in DOCKERFILES:
        for word, rest in dockerfile_instructions(path):
            if word in ("CMD", "ENTRYPOINT"):
                value = json.loads(rest) if rest.startswith("[") else rest
                found.append((f"docker/{path.name} {word}", command_argv(value, SAMPLE_ENV)))
    return found


COMMANDS = foldwise_commands()


def test_files_exist_and_name_commands():
    assert COMPOSE.exists() and {p.name for p in DOCKERFILES} == {"api.Dockerfile", "worker.Dockerfile"}
    subcommands = {argv[1] for _, argv in COMMANDS if argv[:1] == ["foldwise"]}
    assert {"serve", "worker", "db"} <= subcommands


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_foldwise_command_parses(where, argv, capsys):
    assert argv[0] == "foldwise", f"{where}: runs {argv[0]!r}, expected the foldwise CLI"
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse with service.cli: {capsys.readouterr().err.strip()}")
    db = getattr(args, "db", None)
    if db is not None:
        url = sa.engine.make_url(db)
        if where.startswith("docker-compose"):
            assert url.drivername == "postgresql+psycopg" and url.host == "postgres", (where, db)


def test_compose_wiring():
    services = load_compose()["services"]
    assert {"postgres", "migrate", "api", "worker"} <= set(services)
    pg = services["postgres"]
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
    assert services["migrate"]["command"][1:3] == ["db", "upgrade"]
    api = services["api"]["command"]
    assert api[1] == "serve" and api[api.index("--host") + 1] == "0.0.0.0"
    worker = services["worker"]["command"]
    assert worker[1] == "worker" and worker[worker.index("--measurer") + 1] == "cuda"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    assert "deploy" not in services["api"]  # the API needs no GPU


def test_compose_builds_point_at_real_files():
    for name, service in load_compose()["services"].items():
        build = service.get("build")
        if build is None:
            continue
        context = ROOT / build["context"]
        assert context.is_dir(), name
        assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_copies_exist(path):
    copies = [rest for word, rest in dockerfile_instructions(path) if word == "COPY"]
    assert copies
    for rest in copies:
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        for source in parts[:-1]:
            assert (ROOT / source).exists(), f"{path.name}: COPY {source}: no such path in the repository"
    assert any("migrations" in c for c in copies)  # `foldwise db upgrade` needs them in the image


def test_images_pin_torch():
    api = dict(dockerfile_instructions(ROOT / "docker" / "api.Dockerfile"))
    instructions = dockerfile_instructions(ROOT / "docker" / "api.Dockerfile")
    assert re.match(r"python:3\.1[1-9]-slim", api["FROM"])
    text = " ".join(rest for _, rest in instructions)
    assert "download.pytorch.org/whl/cpu" in text and "TORCH_VERSION=2.13.0" in text
    worker = dockerfile_instructions(ROOT / "docker" / "worker.Dockerfile")
    base = next(rest for word, rest in worker if word == "ARG" and rest.startswith("CUDA_IMAGE="))
    assert base.split("=", 1)[1].startswith(("nvidia/cuda:", "pytorch/pytorch:"))
    assert "TORCH_VERSION=2.13.0" in " ".join(rest for _, rest in worker)
