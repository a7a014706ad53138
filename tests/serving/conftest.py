"""Fixtures: a shared `polyspec serve` over the tiny model family, and a factory for private ones.

Every process started here is stopped (SIGTERM, then SIGKILL) when its fixture ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from serving_helpers import ServerProcess, free_port, write_config

from polyspec.client import Client


@pytest.fixture
def start_server(tmp_path):
    """start_server(config, state_dir=None, *extra) -> ServerProcess; all stopped at the end."""
    started: list[ServerProcess] = []

    def start(config: str, state_dir: Path | None = None, *extra: str) -> ServerProcess:
        server = ServerProcess(config, state_dir or tmp_path / "state", *extra)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def serving_config(tiny_family, tmp_path_factory) -> str:
    return write_config(tmp_path_factory.mktemp("serving") / "chain.yaml", tiny_family)


@pytest.fixture(scope="session")
def server(serving_config, tmp_path_factory):
    """One shared server (no auth, max_queue 64, OpenAI API on `http_port`, /metrics on
    `metrics_port`) for the tests that only talk to it."""
    http_port, metrics_port = free_port(), free_port()
    process = ServerProcess(serving_config, tmp_path_factory.mktemp("shared") / "state", "--http-port", str(http_port),
                            "--metrics-port", str(metrics_port))
    process.http_port, process.metrics_port = http_port, metrics_port
    try:
        process.wait_ready().close()
        yield process
    finally:
        process.stop()


@pytest.fixture
def client(server):
    with Client(server.address) as connected:
        yield connected
