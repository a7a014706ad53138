"""`cluster/try-local.sh` end to end, as a user runs it: `up` makes a 3-node Ray cluster by
`ray up` on loopback addresses and starts `polyspec serve` on the head; `check` asks the
server through the SDK and compares with embedded mode, and prints `ray status -v`; `down`
must leave no process behind. About 2-3 minutes on 2 cores.

Opt-in (marker `needs_root`, deselected by default): it installs packages with apt-get,
starts sshd on port 22 and needs root (or passwordless sudo) for PID namespaces, and free
ports (22 on 127.0.0.1-3, 6379, 50051, 9464). Run it with
`python -m pytest -m needs_root tests/deploy/test_try_local.py`; skipped when a requirement
is missing, or with POLYSPEC_SKIP_TRY_LOCAL=1. Every step is bounded, and `down` runs in a
finalizer whatever failed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "cluster" / "try-local.sh"
NODE_TIERS = {"127.0.0.2": "tier_mid", "127.0.0.3": "tier_small"}  # the head carries tier_target


def _busy(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0


def _why_not() -> str | None:
    if os.environ.get("POLYSPEC_SKIP_TRY_LOCAL"):
        return "POLYSPEC_SKIP_TRY_LOCAL is set"
    if os.geteuid() != 0 and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode != 0:
        return "needs root or passwordless sudo (sshd on port 22, PID namespaces)"
    if not shutil.which("unshare"):
        return "needs unshare (util-linux)"
    busy = [f"{h}:{p}" for h, p in [("127.0.0.1", 22), ("127.0.0.2", 22), ("127.0.0.3", 22), ("127.0.0.1", 6379), ("127.0.0.1", 50051), ("127.0.0.1", 9464)] if _busy(h, p)]
    return f"ports in use: {', '.join(busy)}" if busy else None


def _processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line or environment names `text` (the state folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline or text in environ:
            found.append(f"{proc.name}: {cmdline[:120]}")
    return found


def _node_blocks(status: str) -> dict[str, str]:
    """`ray status -v`'s per-node sections: {node address: section text}."""
    parts = re.split(r"^Node: (\S+).*$", status, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.mark.needs_root
@pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
def test_up_serves_each_tier_on_its_own_node_and_down_leaves_nothing(tmp_path):
    state = f"/tmp/polyspec-try-local-test-{os.getpid()}"
    env = {**os.environ, "POLYSPEC_TRY_LOCAL_DIR": state}

    def run(command: str, timeout: int) -> subprocess.CompletedProcess:
        # its own process group: on a timeout the script's children (ray up, ssh) go too
        proc = subprocess.Popen(["bash", str(SCRIPT), command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n(timed out after {timeout}s)"
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    try:
        up = run("up", timeout=1200)
        assert up.returncode == 0, up.stderr[-3000:]
        assert up.stdout.strip().splitlines()[-1] == "127.0.0.1:50051"

        check = run("check", timeout=600)
        assert check.returncode == 0, check.stderr[-3000:]
        assert "served output equals embedded mode on 3 greedy prompts" in check.stderr

        nodes = _node_blocks(check.stdout)
        assert len(nodes) == 3, check.stdout
        in_use = {ip: re.findall(r"1\.0/1\.0 (tier_\w+)", block) for ip, block in nodes.items()}
        for ip, tier in NODE_TIERS.items():
            assert in_use[ip] == [tier], in_use
        (head,) = set(nodes) - set(NODE_TIERS)  # Ray names the head by the machine's address
        assert in_use[head] == ["tier_target"], in_use
    finally:
        down = run("down", timeout=120)
    assert down.returncode == 0, down.stderr
    assert _processes_mentioning(state) == []
    assert not any(_busy(ip, 22) for ip in ("127.0.0.1", "127.0.0.2", "127.0.0.3"))
    assert not _busy("127.0.0.1", 50051) and not _busy("127.0.0.1", 6379)
    assert not Path(state).exists()
