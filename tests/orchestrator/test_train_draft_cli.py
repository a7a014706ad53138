"""`polyspec train-draft` end to end on a tiny target: it trains, saves, and a second run resumes."""

import json
import subprocess
import sys

import pytest


def _train(tiny_family, work, out, steps):
    command = [
        sys.executable, "-m", "polyspec", "train-draft", "--target", tiny_family["target"], "--kind", "feature",
        "--out", str(out), "--work", str(work), "--steps", str(steps), "--minutes", "2", "--batch", "1",
        "--context", "16", "--corpus-tokens", "4000", "--report-prompts", "0", "--device", "auto",
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.extended
def test_train_draft_trains_saves_and_resumes(tiny_family, tmp_path):
    work, out = tmp_path / "work", tmp_path / "head"
    first = _train(tiny_family, work, out, 2)
    assert first.returncode == 0, first.stderr[-2000:]
    meta = json.loads((out / "drafter.json").read_text())
    assert meta["kind"] == "feature"
    assert meta["training"]["steps"] == 2 and meta["training"]["tokens"] == 2 * 16
    assert (work / "feature-fspad" / "train.ckpt").exists()
    second = _train(tiny_family, work, out, 3)  # the schedule grows by one step: the checkpoint's two are kept
    assert second.returncode == 0, second.stderr[-2000:]
    meta = json.loads((out / "drafter.json").read_text())
    assert meta["training"]["steps"] == 3 and meta["training"]["tokens"] == 3 * 16


def test_train_draft_refuses_a_missing_cuda_in_one_line(tiny_family, tmp_path):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    command = [sys.executable, "-m", "polyspec", "train-draft", "--target", tiny_family["target"], "--kind", "feature",
               "--out", str(tmp_path / "h"), "--work", str(tmp_path / "w"), "--device", "cuda"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "no CUDA device" in result.stderr
