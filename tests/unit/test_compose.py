"""compose.yaml (and the CPU override) against the Compose Specification, with no Docker engine: the
schema's JSON (vendored in tests/data) through jsonschema, and the `compose-spec`
package's validating parser from PyPI (so a fresh clone checks it too). The commands compose runs are
parsed by the real CLI and must be the ones `tandem up` runs."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from typer.main import get_command

from tandem.cli import app
from tandem.launcher import Stack, StackOptions

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"  # vendored: tests/data/README.md names its source
WORKERS = ("prefill", "decode")
TANDEM_SERVICES = ("model", "prefill", "decode", "gateway")

@dataclass(frozen=True)
class _Reset:
    """compose's `!reset VALUE` tag: drop what the base file set (VALUE is what the file alone holds)."""

    value: Any


class _ComposeLoader(yaml.SafeLoader):
    """YAML as compose reads it: merge keys (as SafeLoader) and the `!reset` tag."""


def _construct_reset(loader: yaml.SafeLoader, node: yaml.Node) -> _Reset:
    if isinstance(node, yaml.MappingNode):
        return _Reset(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return _Reset(loader.construct_sequence(node, deep=True))
    return _Reset(loader.construct_scalar(node) or None)  # type: ignore[arg-type]


_ComposeLoader.add_constructor("!reset", _construct_reset)


def _alone(tree: Any) -> Any:
    """A file as compose validates it on its own, before merging: each `!reset` holds its value."""
    if isinstance(tree, _Reset):
        return tree.value
    if isinstance(tree, dict):
        return {key: _alone(value) for key, value in tree.items()}
    return [_alone(value) for value in tree] if isinstance(tree, list) else tree


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: ${VAR}, ${VAR:-default}, ${VAR-default}, and $$ for a dollar."""
    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, default = match.group(1), match.group(2), match.group(3)
        value = env.get(name)
        if operator == ":-" and not value or operator == "-" and value is None:
            return default
        return value or ""

    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}", substitute, text)


_REPLACED_SEQUENCES = ("command", "entrypoint", "test")


def merge(base: Any, override: Any, key: str = "") -> Any:
    """The override file applied to the base, by compose's rules: mappings merge, sequences append
    (except shell commands, which are replaced), scalars are replaced, `!reset` drops a key."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for name, value in override.items():
            if isinstance(value, _Reset):
                merged.pop(name, None)
            else:
                merged[name] = merge(base[name], value, name) if name in base else value
        return merged
    if isinstance(base, list) and isinstance(override, list) and key not in _REPLACED_SEQUENCES:
        return base + override
    return override


def load_file(name: str, env: Mapping[str, str] | None = None) -> Any:
    return yaml.load(interpolate((ROOT / name).read_text(), env or {}), Loader=_ComposeLoader)


def load(*names: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The application model of `docker compose -f NAME -f NAME ...`."""
    model: Any = {}
    for name in names:
        model = merge(model, load_file(name, env))
    return model


PROJECTS = {"gpu": ("compose.yaml",), "cpu": ("compose.yaml", "compose.cpu.yaml")}


@pytest.mark.parametrize("project", sorted(PROJECTS))
def test_valid_against_the_compose_spec_schema(project: str) -> None:
    # Draft 7, as the schema declares (its "$schema" URL lacks the "#" jsonschema looks validators up by).
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    for name in PROJECTS[project]:  # each file alone, as compose checks them before merging
        validator.validate(_alone(load_file(name)))
    validator.validate(load(*PROJECTS[project]))


@pytest.mark.parametrize("project", sorted(PROJECTS))
def test_valid_for_the_compose_spec_parser(project: str) -> None:
    compose_spec = pytest.importorskip("compose_spec", reason="pip install compose-spec (the test extra)")
    model = load(*PROJECTS[project])
    # The parser rejects unknown keys, bad durations and image names, and undefined volumes or networks.
    compose_spec.PyOptions(apply_merge=True).from_yaml(yaml.safe_dump(model)).validate()
    for name, service in model["services"].items():  # what neither checks: services depended on exist
        assert set(service.get("depends_on", {})) <= set(model["services"]) - {name}, name


def test_gpu_layout() -> None:
    services = load("compose.yaml", env={"PREFILL_GPU": "0", "DECODE_GPU": "1"})["services"]
    for role, gpu in (("prefill", "0"), ("decode", "1")):
        (device,) = services[role]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["device_ids"] == [gpu]
        assert services[role]["ipc"] == "host"  # cuda-ipc between the workers sharing a GPU
        assert "ports" not in services[role]
    published = {name for name, service in services.items() if service.get("ports")}
    assert published == {"gateway", "jaeger"}
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert any(port.startswith("16686:") for port in services["jaeger"]["ports"])
    for name in TANDEM_SERVICES:
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    depends = services["gateway"]["depends_on"]
    assert {depends[name]["condition"] for name in ("redis", *WORKERS)} == {"service_healthy"}

    cpu = load("compose.yaml", "compose.cpu.yaml")["services"]
    for role in WORKERS:
        assert "deploy" not in cpu[role]
        assert cpu[role]["command"][cpu[role]["command"].index("--device") + 1] == "cpu"
        assert cpu[role]["build"]["args"]["TORCH_VARIANT"] == "cpu"


def _parse(args: list[str]) -> dict[str, Any]:
    """Parse `tandem ARGS` as the real CLI does (unknown options and bad values raise); the parameters."""
    command = get_command(app)
    name, *rest = args
    subcommand = command.commands[name]  # type: ignore[attr-defined]
    with subcommand.make_context(name, rest) as context:
        return dict(context.params)


def _flags(args: list[str]) -> set[str]:
    return {arg for arg in args if arg.startswith("--")}


@pytest.mark.parametrize("project", sorted(PROJECTS))
def test_commands_are_the_cli_commands_tandem_up_runs(project: str, tmp_path: Path) -> None:
    services = load(*PROJECTS[project])["services"]
    device = "cuda" if project == "gpu" else "cpu"
    stack = Stack(StackOptions(model="smollm2-135m", redis_url="redis://redis:6379/0", device=device,
                               log_dir=tmp_path))
    stack._plan()  # the commands `tandem up` would start, as [python, -m, tandem.cli, role, ...]
    launched = {service.role: service.command[3:] for service in stack.services}
    for role in (*WORKERS, "gateway"):
        command = services[role]["command"]
        params = _parse(command)
        assert command[0] == role and params["redis"] == "redis://redis:6379/0" and params["host"] == "0.0.0.0"
        # Every option compose passes is one `tandem up` passes too: the e2e tests run these commands.
        assert _flags(command) <= _flags(launched[role]), _flags(command) - _flags(launched[role])
        if role in WORKERS:
            assert params["device"] == device
        health = services[role]["healthcheck"]["test"]
        assert health[:3] == ["CMD", "tandem", "healthcheck"]
        assert health[3] == f"127.0.0.1:{params['port']}"  # its own gRPC port
        _parse(health[2:])
    assert _parse(services["model"]["command"])["name"] == "smollm2-135m"
