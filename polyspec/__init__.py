"""polyspec: lossless multi-tier ("polybasic") speculative decoding.

The package is layered; each layer imports only the layers below it:

    polyspec.workers.core          verification rules, draft trees, sampling, KV bookkeeping (pure math)
    polyspec.workers.tiers         the models of a chain behind the `Tier` interface, and their loading
    polyspec.orchestrator.decode   the chain scheduler and its public round API
    polyspec.orchestrator.tuning   the goodput planner, its start-up profiles and options
    polyspec.orchestrator.distributed  tier workers, the tier-to-tier transport, the Ray runtime
    polyspec.orchestrator.engine   one configured chain: requests in, results out
    polyspec.orchestrator.serving  the gRPC server, its request loop, jobs, metrics, HTTP
    polyspec.orchestrator.cli      the `polyspec` command

`polyspec.client` is the SDK (grpcio and protobuf only); `polyspec.protos` holds the
gRPC contracts; `polyspec.harness` holds the benchmark, tuning and model-zoo harnesses,
which nothing in the runtime imports. The folders `workers/`, `orchestrator/` and
`protos/` of the source tree are installed as `polyspec.workers`, `polyspec.orchestrator`
and `polyspec.protos`.
"""

__version__ = "0.2.0"
