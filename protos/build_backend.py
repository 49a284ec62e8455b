"""PEP 517 backend: setuptools, with the gRPC/protobuf code generated from protos/ first.

Generated modules are never committed or hand-edited; every build or editable install
regenerates them next to their .proto files (protos/tandem/v1 is the package `tandem.v1`).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import build_meta as _orig
from setuptools.build_meta import *  # noqa: F401,F403  (re-export the hooks we do not wrap)

_PROTO_ROOT = Path(__file__).resolve().parent


def generate() -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    sources = sorted(str(p.relative_to(_PROTO_ROOT)) for p in (_PROTO_ROOT / "tandem" / "v1").glob("*.proto"))
    if not sources:
        return
    args = [
        "grpc_tools.protoc",
        f"-I{_PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={_PROTO_ROOT}",
        f"--pyi_out={_PROTO_ROOT}",
        f"--grpc_python_out={_PROTO_ROOT}",
        *sources,
    ]
    import os

    cwd = os.getcwd()
    os.chdir(_PROTO_ROOT)
    try:
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {sources}")
    finally:
        os.chdir(cwd)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):  # type: ignore[no-untyped-def]
    generate()
    return _orig.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):  # type: ignore[no-untyped-def]
    generate()
    return _orig.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):  # type: ignore[no-untyped-def]
    generate()
    return _orig.build_sdist(sdist_directory, config_settings)
