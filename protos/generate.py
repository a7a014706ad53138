"""Regenerate the Python stubs next to each .proto: `python -m polyspec.protos.generate [OUT_DIR]`.

protoc writes `from polyspec.v1 import polyspec_pb2` into the gRPC stub (the import path
the .proto is compiled under); the stubs live in the `protos` package, so that one import
is rewritten to `from polyspec.protos.polyspec.v1 import ...`. tests/serving/test_stubs.py
regenerates into a temporary folder and checks the committed files are identical.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ("polyspec/v1/polyspec.proto", "polyspec/v1/tier.proto")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Compile every proto into `out_dir` (same relative layout); returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    includes = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    for proto in PROTO_FILES:
        (out_dir / proto).parent.mkdir(parents=True, exist_ok=True)
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{includes}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            proto,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    written = []
    for proto in PROTO_FILES:
        stem = out_dir / proto[: -len(".proto")]
        for suffix in GENERATED_SUFFIXES:
            path = Path(str(stem) + suffix)
            text = path.read_text(encoding="utf-8")
            package = ".".join(Path(proto).parent.parts)  # polyspec.v1
            text = text.replace(f"from {package} import", f"from polyspec.protos.{package} import")
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT):
        print(path)
