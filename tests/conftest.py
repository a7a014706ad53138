"""Shared fixtures: tiny random Llama families and a byte-level tokenizer in temp folders.

Nothing is downloaded: every model here is built from a config with a fixed seed and
saved with `save_pretrained`, so the loading code under test is the real `from_pretrained`.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a typo'd path must fail fast, not wait on a network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Ray waits 30 s for a new head's GCS to write its port; a CI run (2 cores, the full suite) once took longer, and every
# test of the module whose cluster it was failed at setup. Every cluster a test starts inherits this.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")

import pytest
import torch

torch.set_num_threads(1)

from tiny_models import EOS, make_model, make_tokenizer  # noqa: E402,F401  (fixtures below; tests import tiny_models)


SESSION_MARKER = "POLYSPEC_TEST_SESSION"  # inherited by every process a test starts (servers, Ray nodes and their workers)


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """The suite leaves no process running, whatever a test or a library forgot: at the end, every
    process whose environment carries this session's marker is killed (one line says which).
    Ray workers have been seen to outlive their cluster's shutdown."""
    import uuid

    import psutil

    marker = uuid.uuid4().hex
    os.environ[SESSION_MARKER] = marker
    yield
    own = os.getpid()
    leftovers = []
    for process in psutil.process_iter(["pid", "name"]):
        try:
            if process.pid != own and process.environ().get(SESSION_MARKER) == marker:
                leftovers.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    for process in leftovers:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    if leftovers:
        names = ", ".join(sorted({p.info["name"] or "?" for p in leftovers}))
        print(f"\nconftest: killed {len(leftovers)} process(es) the tests left running: {names}")


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """{'target', 'mid', 'small', 'other_vocab'} -> model directories.

    mid is a lightly perturbed copy of the target (high agreement), small an unrelated
    smaller model (low agreement), other_vocab a model with a different vocabulary.
    """
    root = tmp_path_factory.mktemp("tiny_family")
    tokenizer = make_tokenizer()
    target = make_model(root / "target", tokenizer, hidden=64, layers=2, seed=1)
    make_model(root / "mid", tokenizer, hidden=64, layers=2, seed=2, base=target, noise=0.05)
    make_model(root / "small", tokenizer, hidden=32, layers=1, seed=3)
    make_model(root / "other_vocab", make_tokenizer(extra_tokens=5), hidden=32, layers=1, seed=4)
    return {name: str(root / name) for name in ("target", "mid", "small", "other_vocab")}


@pytest.fixture(scope="session")
def tiny_drafters(tiny_family, tmp_path_factory):
    """tiny_family plus trained-drafter checkpoints over its target:

    - "feature": a feature head trained for a few steps on the target's own samples;
    - "early_exit": the target's first layer plus an adapter copied from its second layer
      and final norm, i.e. exactly the target (every draft is accepted);
    - "early_exit_noisy": the same adapter perturbed (some drafts rejected).
    Losslessness does not depend on how good a drafter is, only on its rows being used
    consistently, so the heads are cheap to make.
    """
    from transformers import AutoModelForCausalLM

    from polyspec.harness.train_draft import FeatureObjective, train
    from polyspec.workers.tiers.drafters import new_drafter, save_drafter

    root = tmp_path_factory.mktemp("tiny_drafters")
    target = AutoModelForCausalLM.from_pretrained(tiny_family["target"]).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        stream = target.generate(torch.tensor([[10, 20, 30]]), max_new_tokens=200, do_sample=True, eos_token_id=None, pad_token_id=0)[0].numpy()
    head, meta = new_drafter("feature", target)
    train(target, head, FeatureObjective(target, head, "fspad"), stream, root / "feature.ckpt",
          steps=30, batch=4, context=48, lr=3e-3, minutes=5, seed=0, desc="tiny feature head")
    save_drafter(root / "feature", "feature", head, meta, torch.float32)
    adapter, meta = new_drafter("early_exit", target, layers=1)
    save_drafter(root / "early_exit", "early_exit", adapter, meta, torch.float32)  # exact: the target itself
    with torch.no_grad():
        for parameter in adapter.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn_like(parameter))
    save_drafter(root / "early_exit_noisy", "early_exit", adapter, meta, torch.float32)
    return {**tiny_family, **{name: str(root / name) for name in ("feature", "early_exit", "early_exit_noisy")}}
