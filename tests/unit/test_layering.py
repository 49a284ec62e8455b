"""The layering, read from the source (AST, nothing imported): which part may import which.

Layers, bottom up: `tandem.common` (value types: config, errors, sampling parameters, validation) →
`tandem.kernels` → `tandem.models` (names, configs, tokenizers; no torch at import) → `tandem.engine` →
`tandem.serving` (rpc, registry, telemetry, metrics, KV transfer, the engine thread) → the services
(`tandem.prefill_svc`, `tandem.decode_svc`, `tandem.gateway`) → `tandem.cli` / `tandem.launcher`.
An edge that runs the wrong way fails here with the file and line. The gateway process must not load torch
at all, so the module-level import closure of every gateway module is checked too (imports inside a function
run only when it is called; those are checked by the direct rules).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Folder → import name, as pyproject.toml's package-dir maps them.
PACKAGE_DIRS = {
    "shared": "tandem",
    "kernels": "tandem.kernels",
    "prefill_svc": "tandem.prefill_svc",
    "decode_svc": "tandem.decode_svc",
    "gateway": "tandem.gateway",
    "benchmarks": "tandem.benchmarks",
}
SERVICES = ("tandem.prefill_svc", "tandem.decode_svc", "tandem.gateway")
TRANSPORT = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "opentelemetry", "redis", "fastapi",
             "uvicorn", "starlette", "prometheus_client", "tandem.v1")


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    target: str  # imported module (for `from X import Y`, X and X.Y are both recorded)
    path: Path
    line: int
    is_module_level: bool


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    package = PACKAGE_DIRS[rel.parts[0]]
    parts = list(rel.with_suffix("").parts[1:])
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_of(path: Path) -> Iterator[Import]:
    module = _module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))

    def visit(node: ast.AST, is_module_level: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:  # the `else` of a TYPE_CHECKING block runs
                    yield from visit(stmt, is_module_level)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(module, alias.name, path, child.lineno, is_module_level)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{path}:{child.lineno}: use absolute imports"
                base = child.module or ""
                yield Import(module, base, path, child.lineno, is_module_level)
                for alias in child.names:
                    yield Import(module, f"{base}.{alias.name}", path, child.lineno, is_module_level)
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from visit(child, is_module_level and not nested)

    yield from visit(tree, True)


def _all_imports() -> list[Import]:
    return [imp for folder in PACKAGE_DIRS for path in sorted((ROOT / folder).rglob("*.py"))
            for imp in _imports_of(path)]


IMPORTS = _all_imports()
MODULES = {imp.importer for imp in IMPORTS} | {_module_name(p) for f in PACKAGE_DIRS for p in (ROOT / f).rglob("*.py")}


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _violations(importers: tuple[str, ...], forbidden: tuple[str, ...], module_level_only: bool = False) -> list[str]:
    return [f"{imp.path.relative_to(ROOT)}:{imp.line}: {imp.importer} imports {imp.target}"
            for imp in IMPORTS
            if _under(imp.importer, *importers) and _under(imp.target, *forbidden)
            and (imp.is_module_level or not module_level_only)]


def test_the_source_is_found() -> None:
    assert "tandem.engine.engine" in MODULES and "tandem.gateway.server" in MODULES
    assert len(IMPORTS) > 300


def test_common_imports_only_the_standard_library() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = [f"{imp.path.relative_to(ROOT)}:{imp.line}: {imp.target}" for imp in IMPORTS
           if _under(imp.importer, "tandem.common") and not _under(imp.target, "tandem.common")
           and imp.target.split(".")[0] not in stdlib]
    assert not bad, "tandem.common is the torch-free leaf every part imports:\n" + "\n".join(bad)


def test_kernels_import_nothing_of_the_project() -> None:
    bad = [v for v in _violations(("tandem.kernels",), ("tandem",)) if " imports tandem.kernels" not in v]
    assert not bad, "\n".join(bad)


def test_engine_has_no_transport() -> None:
    bad = _violations(("tandem.engine",), (*TRANSPORT, "tandem.serving", *SERVICES, "tandem.cli", "tandem.launcher"))
    assert not bad, "the engine core knows nothing of gRPC, tracing, the registry or the services:\n" + "\n".join(bad)


def test_models_need_no_torch_at_import() -> None:
    bad = _violations(("tandem.models",), ("torch", "tandem.engine", "tandem.kernels", "tandem.serving", *SERVICES),
                      module_level_only=True)
    assert not bad, "\n".join(bad)


def test_serving_plumbing_does_not_reach_up() -> None:
    bad = _violations(("tandem.serving",), (*SERVICES, "tandem.cli", "tandem.launcher", "tandem.benchmarks"))
    assert not bad, "\n".join(bad)


def test_gateway_never_touches_the_engine_or_torch() -> None:
    bad = _violations(("tandem.gateway",), ("torch", "triton", "tandem.engine", "tandem.kernels"))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("service", SERVICES)
def test_services_do_not_import_each_other(service: str) -> None:
    others = tuple(s for s in SERVICES if s != service)
    bad = _violations((service,), others)
    assert not bad, "\n".join(bad)


def _module_level_closure(start: str) -> dict[str, str]:
    """Every module a fresh `import start` loads at module level (tandem modules followed; external ones
    recorded, not followed), mapped to the chain that reaches it."""
    edges: dict[str, list[str]] = {}
    for imp in IMPORTS:
        if imp.is_module_level:
            edges.setdefault(imp.importer, []).append(imp.target)
    reached = {start: start}
    todo = [start]
    while todo:
        module = todo.pop()
        # Importing a.b.c runs a/__init__ and a/b/__init__ first.
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        for target in [*parents, *edges.get(module, [])]:
            if target in reached:
                continue
            if target.startswith("tandem") and target not in MODULES:
                continue  # `from tandem.x import name`: the name, not a module
            reached[target] = f"{reached[module]} → {target}"
            if target in MODULES:
                todo.append(target)
    return reached


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _under(m, "tandem.gateway")))
def test_gateway_process_loads_no_torch(module: str) -> None:
    reached = _module_level_closure(module)
    bad = [chain for target, chain in reached.items()
           if _under(target, "torch", "triton", "tandem.engine", "tandem.kernels", "transformers")]
    assert not bad, "\n".join(bad)


def test_gateway_process_loads_no_torch_at_run_time() -> None:
    """The same, executed: the modules the gateway process imports leave torch unloaded."""
    code = ("import sys, tandem.gateway.server, tandem.gateway.http_api, tandem.cli; "
            "assert 'torch' not in sys.modules, 'torch'; assert 'transformers' not in sys.modules, 'transformers'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
