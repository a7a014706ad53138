"""The committed gRPC stubs match the .proto, and the SDK stays light to import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from polyspec.protos.generate import GENERATED_SUFFIXES, PROTO_FILES, PROTO_ROOT, generate

REPO = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_proto(tmp_path):
    generate(tmp_path)
    for proto in PROTO_FILES:
        stem = proto[: -len(".proto")]
        for suffix in GENERATED_SUFFIXES:
            fresh = (tmp_path / (stem + suffix)).read_text()
            committed = (PROTO_ROOT / (stem + suffix)).read_text()
            assert committed == fresh, f"protos/{stem}{suffix} is stale: run `python -m polyspec.protos.generate`"


def test_sdk_imports_no_torch_ray_or_transformers():
    code = (
        "import sys; import polyspec.client as c; c.Client('127.0.0.1:1').close(); "
        "heavy = sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules); "
        "assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
