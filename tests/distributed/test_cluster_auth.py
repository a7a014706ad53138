"""A tier worker answers only callers that carry its chain's cluster token, and binds the
host it is given (on a Ray node: the node's address)."""

from __future__ import annotations

import grpc
import pytest

from polyspec.orchestrator.distributed import cluster_auth
from polyspec.orchestrator.distributed.worker import TierWorker
from polyspec.protos.polyspec.v1 import tier_pb2, tier_pb2_grpc
from polyspec.workers.tiers.tier import NGramTier


@pytest.fixture
def worker():
    tier_worker = TierWorker(NGramTier("ng", 300), 0, host="127.0.0.1")
    yield tier_worker
    tier_worker.stop()


def test_a_tier_worker_needs_the_cluster_token(worker, monkeypatch):
    assert worker.address.startswith("127.0.0.1:")
    with cluster_auth.insecure_channel(worker.address) as channel:
        assert tier_pb2_grpc.TierStub(channel).Health(tier_pb2.HealthRequest(), timeout=10).tier == "ng"
    with grpc.insecure_channel(worker.address) as channel:  # no token
        with pytest.raises(grpc.RpcError) as caught:
            tier_pb2_grpc.TierStub(channel).Health(tier_pb2.HealthRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as caught:
            tier_pb2_grpc.TierStub(channel).Health(tier_pb2.HealthRequest(), timeout=10,
                                                  metadata=((cluster_auth.METADATA_KEY, "not-the-token"),))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    monkeypatch.setenv(cluster_auth.TOKEN_ENV, "another-chain")
    with cluster_auth.insecure_channel(worker.address) as channel:  # another chain's token
        with pytest.raises(grpc.RpcError) as caught:
            tier_pb2_grpc.TierStub(channel).Health(tier_pb2.HealthRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_actors_start_with_the_drivers_token():
    assert cluster_auth.actor_runtime_env() == {"env_vars": {cluster_auth.TOKEN_ENV: cluster_auth.cluster_token()}}
