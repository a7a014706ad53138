"""The cluster token: a tier worker's gRPC server answers only callers of its own chain.

A tier worker listens on its node's address (the one Ray gives it), which other machines
can reach. Every tier-to-tier and driver-to-tier call carries the metadata
`x-polyspec-cluster-token`; a worker turns away any call without it (UNAUTHENTICATED).

The token comes from POLYSPEC_CLUSTER_TOKEN, or is drawn at random by the first process
that asks (the driver) and put in its environment; the driver starts its tier actors with
that variable (`actor_runtime_env`), so one chain shares one token and a second chain on
the same cluster has another.
"""

from __future__ import annotations

import hmac
import os
import secrets

import grpc

TOKEN_ENV = "POLYSPEC_CLUSTER_TOKEN"
METADATA_KEY = "x-polyspec-cluster-token"


def cluster_token() -> str:
    token = os.environ.get(TOKEN_ENV)
    if not token:
        token = secrets.token_hex(32)
        os.environ[TOKEN_ENV] = token
    return token


def actor_runtime_env() -> dict:
    """The runtime_env a tier actor is started with: the driver's cluster token."""
    return {"env_vars": {TOKEN_ENV: cluster_token()}}


class _RequireToken(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = token.encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)  # every Tier method is unary

    def intercept_service(self, continuation, details):
        given = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._expected):
            return continuation(details)
        return self._deny


def server_interceptors() -> list:
    """For a tier worker's `grpc.server(..., interceptors=...)`."""
    return [_RequireToken(cluster_token())]


class _AddToken(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._metadata = (METADATA_KEY, token)

    def intercept_unary_unary(self, continuation, details, request):
        metadata = list(details.metadata or ()) + [self._metadata]
        details = _Details(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready,
                           details.compression)
        return continuation(details, request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def insecure_channel(address: str, options=None) -> grpc.Channel:
    """`grpc.insecure_channel` whose calls carry the cluster token."""
    return grpc.intercept_channel(grpc.insecure_channel(address, options=options), _AddToken(cluster_token()))
