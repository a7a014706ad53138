"""Helpers for the serving tests: a real `polyspec serve` subprocess on loopback.

The server binds port 0 and the test reads the port from its first log line, so no two
tests race for a port. Every process started here is stopped (SIGTERM, then SIGKILL)
when its fixture ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from polyspec.client import Client

START_TIMEOUT_S = 60.0
DEMO_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")  # the shipped CPU demo chain
LISTENING = re.compile(r"listening on [\d.]+:(\d+)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def polyspec_command() -> list[str]:
    """The `polyspec` of the Python running the tests (not whichever one PATH finds first)."""
    return [sys.executable, "-m", "polyspec.orchestrator.cli"]


def server_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


class ServerProcess:
    """`polyspec serve` with its log in a file; `address` once it listens, `client()` once ready."""

    def __init__(self, config: str, state_dir: Path, *extra: str) -> None:
        self.log_path = state_dir.parent / f"{state_dir.name}-serve-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "w")
        command = polyspec_command() + ["serve", "-c", config, "--port", "0", "--state-dir", str(state_dir)]
        if "--metrics-port" not in extra:
            command += ["--metrics-port", "0"]
        self.proc = subprocess.Popen(command + list(extra), stdout=self.log, stderr=subprocess.STDOUT, env=server_env())
        self.address = self._wait_listening()

    def _wait_listening(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            match = LISTENING.search(self.log_path.read_text())
            if match:
                return f"127.0.0.1:{match.group(1)}"
            if self.proc.poll() is not None:
                raise RuntimeError(f"polyspec serve exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        raise RuntimeError(f"polyspec serve did not listen within {START_TIMEOUT_S}s:\n{self.log_path.read_text()}")

    def wait_ready(self, **client_args) -> Client:
        client = Client(self.address, **client_args)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not client.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"polyspec serve never became ready:\n{self.output()}")
            time.sleep(0.1)
        return client

    def output(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def demo_chat_config(root: Path) -> Path:
    """The demo chain's config over a copy of its target given a chat template (`CHAT_TEMPLATE`), in `root`."""
    target = root / "target"
    shutil.copytree(Path(DEMO_CONFIG).parents[1] / "models/stdlib/target", target)
    (target / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    config = yaml.safe_load(Path(DEMO_CONFIG).read_text())
    for tier in config["tiers"]:
        if tier["model"] != "ngram":
            tier["model"] = str(target)
    path = root / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def http_server(config: str, state_dir: Path, *extra: str):
    """`polyspec serve` with its HTTP API on a free port (`http_port`), ready; stopped on exit."""
    http_port = free_port()
    process = ServerProcess(config, state_dir, "--http-port", str(http_port), *extra)
    process.http_port = http_port
    try:
        process.wait_ready().close()
        yield process
    finally:
        process.stop()


def write_config(path: Path, tiny_family: dict, max_queue: int = 64, max_new_tokens: int = 12) -> str:
    path.write_text(
        yaml.safe_dump(
            {
                "tiers": [
                    {"name": "target", "model": tiny_family["target"], "threads": 1},
                    {"name": "mid", "model": tiny_family["mid"], "threads": 1},
                    {"name": "ng", "model": "ngram"},
                ],
                "speculation": {"lengths": [4, 2]},
                "sampling": {"max_new_tokens": max_new_tokens},
                "server": {"max_queue": max_queue},
            }
        )
    )
    return str(path)
