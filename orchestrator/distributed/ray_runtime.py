"""`runtime.backend: ray`: one Ray actor per tier, on one node or many.

Ray owns placement, lifecycle and restarts; the data plane is the tier-to-tier gRPC protocol
served by each actor's TierWorker on its node's address (polyspec.orchestrator.distributed.worker), and the
driver is polyspec.orchestrator.distributed.driver.DistributedChain. This module:

- checks the cluster can place every tier before asking (a tier whose resources no node has
  is an error naming the tier and the resource, not a hang);
- starts the actors, one per tier except trained drafters (`actor_groups`), which run in
  their target's actor: one GPU each where the cluster has GPUs (and the tier is a model not
  pinned to `device: cpu`), else one CPU with the tier's torch threads pinned to it
  (`threads`, default 1); `resources` pin a tier to labelled nodes; `placement: spread`
  puts the tiers in a STRICT_SPREAD placement group (one node each);
- wires each tier to the next live tier below it, and rewires on failure: a drafter that
  dies is bypassed at once and wired back in when Ray restarts it (max_restarts); a dead
  target is waited for, and the driver redoes the step that failed;
- joins the tiers into one torch.distributed group when dense rows go out of band
  (`tensor_transport`: nccl between distinct GPUs, gloo when asked; `auto` is nccl on GPUs
  and inline gRPC on CPU, see workers/transport.py for the measurements behind that).
"""

from __future__ import annotations

import os
import socket
import threading
import time

from polyspec.orchestrator.distributed import cluster_auth
from polyspec.orchestrator.config import ChainConfig
from polyspec.orchestrator.distributed.driver import ChainUnavailableError, DistributedChain, Membership, TierView
from polyspec.workers.core.errors import ConfigError

START_TIMEOUT_S = float(os.environ.get("POLYSPEC_RAY_START_TIMEOUT_S", "180"))
RESTART_TIMEOUT_S = float(os.environ.get("POLYSPEC_RAY_RESTART_TIMEOUT_S", "180"))
REPAIR_PERIOD_S = 1.0
REPAIR_JOIN_S = 35.0  # close() waits this long for the repair thread: its longest call is a 30 s setup


def actor_groups(config: ChainConfig) -> list[list[int]]:
    """The tier indices each actor hosts, its own tier first: the target's actor also hosts
    every trained drafter, each other tier has an actor of its own.

    A feature head reads the target's hidden states at every call; they live in the target's
    process next to its KV cache, which rolls them back with it (trees included), so the head
    must run there. An early-exit drafter IS the target's first L layers, its embeddings and
    its LM head, plus one adapter layer: in an actor of its own it would need a copy of all
    of these (for a small model most of the target's weights) and gain only the overlap of
    drafting with verifying that pipelined mode offers; in the target's actor it costs the
    adapter alone, as embedded. Co-located tiers keep a gRPC server each (the protocol and
    the scheduler code stay the same) and share one model lock: one forward at a time.
    """
    tiers = config.tiers
    groups = [[0, *(i for i, t in enumerate(tiers) if t.drafter)]]
    return groups + [[i] for i in range(1, len(tiers)) if not tiers[i].drafter]


class TierActor:
    """The body of a tier's Ray actor: loads its tiers and serves them (a restart re-runs this).
    `tier_configs[0]` is the actor's own tier; the rest are trained drafters over it."""

    def __init__(self, tier_configs, indices: list[int], eos_token_ids: tuple[int, ...], threads: int) -> None:
        import ray
        import torch

        from polyspec.orchestrator.distributed.model_lock import ModelLock
        from polyspec.workers.tiers.loading import load_drafter_tier, load_model_tier, quiet_transformers
        from polyspec.orchestrator.distributed.worker import TierWorker
        from polyspec.workers.tiers.tier import NGramTier

        quiet_transformers()
        torch.set_num_threads(threads)
        own = tier_configs[0]
        if own.is_ngram:
            tiers = [NGramTier(own.name, 1, own.max_ngram, own.min_ngram)]
            self.out_features = 0  # takes the chain's vocabulary
        else:
            tiers = [load_model_tier(own)]
            tiers += [load_drafter_tier(drafter, tiers[0]) for drafter in tier_configs[1:]]
            self.out_features = tiers[0].vocab_size
        lock = ModelLock()
        host = ray.util.get_node_ip_address()
        self.workers = {index: TierWorker(tier, index, eos_token_ids=eos_token_ids, host=host, lock=lock)
                        for index, tier in zip(indices, tiers)}
        self.first = indices[0]
        self.node_id = ray.get_runtime_context().get_node_id()

    def info(self, index: int | None = None) -> dict:
        worker = self.workers[self.first if index is None else index]
        tier = worker.tier
        return {"address": worker.address, "out_features": self.out_features, "max_context": tier.max_context,
                "node_id": self.node_id, "pid": os.getpid(), "device": str(getattr(tier, "device", "cpu"))}

    def setup(self, vocab_size: int) -> None:
        for worker in self.workers.values():
            worker.set_vocab_size(vocab_size)

    def connect(self, index: int, lower_address: str | None) -> str:
        return self.workers[index].connect(lower_address)

    def join_dist(self, backend: str, init_method: str, world_size: int, min_bytes: int | None) -> None:
        # only chains of one tier per actor join a group (config: trained drafters need inline rows)
        (worker,) = self.workers.values()
        worker.join_dist(backend, init_method, world_size, min_bytes)

    def free_port(self) -> str:
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            return f"tcp://{ray.util.get_node_ip_address()}:{sock.getsockname()[1]}"


def _init_ray(address: str | None, num_tiers: int) -> None:
    import ray

    if ray.is_initialized():
        return
    import logging

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # "skipping fork() handlers" each time Ray forks a process
    logging.getLogger("ray").setLevel(logging.ERROR)
    if address:
        try:
            ray.init(address=address, logging_level="error", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(f"runtime.address {address!r}: cannot connect to a Ray cluster ({str(exc).splitlines()[0]})") from None
    else:  # a local instance: one logical CPU per tier at least (the n-gram tier barely uses one)
        ray.init(address="local", num_cpus=max(num_tiers, os.cpu_count() or 1), include_dashboard=False,
                 logging_level="error", log_to_driver=False)


def _requirements(config: ChainConfig, cluster_gpus: float) -> list[dict]:
    out = []
    for tier in config.tiers:
        gpu = cluster_gpus > 0 and not tier.is_ngram and tier.device != "cpu"
        need = {"GPU": 1.0} if gpu else {"CPU": 1.0}
        need.update({str(k): float(v) for k, v in (tier.resources or {}).items()})
        out.append(need)
    return out


def check_placement(config: ChainConfig, nodes: list[dict]) -> list[dict]:
    """Each tier's resource demand; ConfigError naming the tier and the resource no live node has."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    gpus = sum(n.get("Resources", {}).get("GPU", 0) for n in alive)
    needs = _requirements(config, gpus)
    for tier, need in zip(config.tiers, needs):
        if tier.drafter:
            continue  # placed with its target (actor_groups)
        if any(all(n.get("Resources", {}).get(r, 0) >= amount for r, amount in need.items()) for n in alive):
            continue
        missing = next((r for r, amount in need.items() if not any(n.get("Resources", {}).get(r, 0) >= amount for n in alive)), None)
        known = sorted({r for n in alive for r in n.get("Resources", {}) if not r.startswith("node:") and "memory" not in r})
        if missing is not None:
            raise ConfigError(f"tier {tier.name!r} cannot be placed: no node in the Ray cluster has resource {missing!r} "
                              f">= {need[missing]:g} (the cluster has: {', '.join(known)})")
        raise ConfigError(f"tier {tier.name!r} cannot be placed: no single node has all of {need}")
    return needs


class RayMembership(Membership):
    def __init__(self, config: ChainConfig, eos_token_ids: tuple[int, ...]) -> None:
        import ray

        self.config = config
        runtime = config.runtime
        _init_ray(runtime.address, len(config.tiers))
        needs = check_placement(config, ray.nodes())
        self.views = [TierView(t.name, i) for i, t in enumerate(config.tiers)]
        self.groups = actor_groups(config)
        self._lock = threading.RLock()
        self._pending: dict[int, object] = {}  # tier -> in-flight info() of a restarting actor
        self._stop = threading.Event()
        self._repair_wanted = threading.Event()
        self.placement_group = None
        strategies = [None] * len(self.groups)
        if runtime.placement == "spread" and len(self.groups) > 1:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundles = [dict(needs[group[0]]) for group in self.groups]
            self.placement_group = placement_group(bundles, strategy="STRICT_SPREAD")
            ready, _ = ray.wait([self.placement_group.ready()], timeout=START_TIMEOUT_S)
            if not ready:
                raise ConfigError(f"runtime.placement: spread needs {len(bundles)} nodes with {bundles}; the cluster cannot place them")
            strategies = [PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i) for i in range(len(bundles))]
        actor_cls = ray.remote(TierActor)
        self.actors = [None] * len(config.tiers)  # per tier: its actor (co-located tiers share one)
        self.unique_actors = []
        for g, group in enumerate(self.groups):
            tier, need = config.tiers[group[0]], needs[group[0]]
            custom = {k: v for k, v in need.items() if k not in ("CPU", "GPU")}
            options = dict(num_cpus=need.get("CPU", 0), num_gpus=need.get("GPU", 0), resources=custom or None,
                           max_restarts=-1, max_task_retries=0, max_concurrency=4, name=None,
                           runtime_env=cluster_auth.actor_runtime_env())  # the chain's cluster token
            if strategies[g] is not None:
                options["scheduling_strategy"] = strategies[g]
            threads = tier.threads or 1
            actor = actor_cls.options(**options).remote([config.tiers[i] for i in group], group, tuple(eos_token_ids), threads)
            self.unique_actors.append(actor)
            for i in group:
                self.actors[i] = actor
        infos = self._wait_infos()
        models = [info["out_features"] for info in infos if info["out_features"]]
        self.vocab_size = min(models)
        contexts = [info["max_context"] for info in infos if info["max_context"]]
        self.max_context = min(contexts) if contexts else None
        ray.get([actor.setup.remote(self.vocab_size) for actor in self.unique_actors])
        for view, info in zip(self.views, infos):
            view.address, view.vocab_size, view.max_context = info["address"], self.vocab_size, info["max_context"]
        self._wire()
        self.transport = self._join_dist(infos)
        self._repairer = threading.Thread(target=self._repair_loop, name="polyspec-ray-repair", daemon=True)
        self._repairer.start()

    # ----------------------------------------------------------------- startup

    def _wait_infos(self) -> list[dict]:
        import ray

        refs = [actor.info.remote(i) for i, actor in enumerate(self.actors)]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=START_TIMEOUT_S)
        if pending:
            stuck = [self.config.tiers[refs.index(ref)].name for ref in pending]
            self.close()
            raise ConfigError(f"tier(s) {', '.join(map(repr, stuck))} did not start within {START_TIMEOUT_S:g}s "
                              "(the cluster has no free node with the resources they ask for, or their model is still loading)")
        infos = []
        for ref, tier in zip(refs, self.config.tiers):
            try:
                infos.append(ray.get(ref))
            except Exception as exc:  # the actor's constructor failed: a ModelLoadError, say
                self.close()
                cause = getattr(exc, "cause", None) or exc
                from polyspec.workers.core.errors import PolyspecError

                if isinstance(cause, PolyspecError):
                    raise type(cause)(str(cause)) from None
                raise ConfigError(f"tier {tier.name!r} failed to start: {str(cause).strip().splitlines()[-1]}") from None
        return infos

    def _join_dist(self, infos: list[dict]) -> str:
        import ray

        wanted = self.config.runtime.tensor_transport
        devices = [info["device"] for info in infos]
        distinct_gpus = all(d.startswith("cuda") for d in devices) and len({(i["node_id"], d) for i, d in zip(infos, devices)}) == len(devices)
        if wanted == "auto":
            backend = "nccl" if distinct_gpus and len(infos) > 1 else None
        elif wanted == "nccl":
            backend = "nccl" if distinct_gpus else "gloo"  # two tiers sharing a GPU: NCCL cannot pair them
        elif wanted == "gloo":
            backend = "gloo"
        else:
            backend = None  # grpc: rows inline
        if backend is None or len(self.unique_actors) < len(self.actors):
            return "grpc"  # co-located tiers: config allows only auto or grpc
        init_method = ray.get(self.unique_actors[0].free_port.remote())
        min_bytes = os.environ.get("POLYSPEC_DIST_MIN_BYTES")  # tests force tiny rows out of band
        ray.get([actor.join_dist.remote(backend, init_method, len(self.actors), int(min_bytes) if min_bytes else None)
                 for actor in self.actors], timeout=120)
        return backend

    # ------------------------------------------------------------------ wiring

    def _alive_below(self, index: int) -> int | None:
        return next((j for j in range(index + 1, len(self.views)) if self.views[j].up), None)

    def _wire(self) -> None:
        """Each live tier -> the next live tier below it."""
        import ray

        with self._lock:
            calls = []
            for i, view in enumerate(self.views):
                if not view.up:
                    continue
                below = self._alive_below(i)
                calls.append((i, self.actors[i].connect.remote(i, self.views[below].address if below is not None else None)))
            for i, ref in calls:
                try:
                    ray.get(ref, timeout=30)
                except Exception:  # noqa: BLE001 - that tier or the one below died meanwhile; the repair loop sees it
                    self._repair_wanted.set()

    def target_address(self) -> str:
        return self.views[0].address

    def target_failed(self, exc: Exception) -> None:
        import ray

        with self._lock:
            self.views[0].up = False
            deadline = time.monotonic() + RESTART_TIMEOUT_S
            while time.monotonic() < deadline:
                try:
                    info = ray.get(self.actors[0].info.remote(0), timeout=max(1.0, deadline - time.monotonic()))
                except ray.exceptions.GetTimeoutError:
                    break
                except ray.exceptions.RayActorError as err:
                    if "restart" in str(err).lower() or "died" in str(err).lower():
                        time.sleep(0.5)
                        continue
                    raise ChainUnavailableError(f"the target tier is gone: {err}") from None
                if info["address"] == self.views[0].address and self._ping(info["address"]):
                    self.views[0].up = True
                    return  # a transient error: the same actor answers again
                ray.get(self.actors[0].setup.remote(self.vocab_size))
                self.views[0].address, self.views[0].up = info["address"], True
                for i in self.groups[0][1:]:  # its trained drafters restarted with it, on new ports
                    self.views[i].address = ray.get(self.actors[0].info.remote(i), timeout=30)["address"]
                    self.views[i].up = True
                self._wire()
                return
            raise ChainUnavailableError(f"the target tier did not come back within {RESTART_TIMEOUT_S:g}s ({exc})")

    def degraded(self, reason: str) -> None:
        self._repair_wanted.set()

    @staticmethod
    def _ping(address: str) -> bool:
        import grpc

        from polyspec.protos.polyspec.v1 import tier_pb2, tier_pb2_grpc

        try:
            with cluster_auth.insecure_channel(address) as channel:
                tier_pb2_grpc.TierStub(channel).Health(tier_pb2.HealthRequest(), timeout=2.0)
            return True
        except grpc.RpcError:
            return False

    def _repair_loop(self) -> None:
        """Find dead drafters (bypass them) and restarted ones (wire them back in)."""
        import ray

        while not self._stop.is_set():
            self._repair_wanted.wait(REPAIR_PERIOD_S)
            self._repair_wanted.clear()
            if self._stop.is_set():
                return
            changed = False
            for i in range(1, len(self.views)):
                # once the chain is closed (or the driver disconnected) no more Ray calls: a
                # `.remote()` without a connection would reconnect this process to the cluster
                if self._stop.is_set() or not ray.is_initialized():
                    return
                view = self.views[i]
                if view.up and not self._ping(view.address):
                    view.up = False
                    changed = True
                if not view.up:
                    ref = self._pending.get(i)
                    if ref is None:
                        ref = self._pending[i] = self.actors[i].info.remote(i)
                    ready, _ = ray.wait([ref], timeout=0)
                    if not ready:
                        continue
                    self._pending.pop(i, None)
                    try:
                        info = ray.get(ref)
                        ray.get(self.actors[i].setup.remote(self.vocab_size), timeout=30)
                    except Exception:  # noqa: BLE001 - still restarting (or gone for good): try again later
                        continue
                    if self._ping(info["address"]):
                        view.address, view.up = info["address"], True
                        changed = True
            if changed:
                self._wire()

    def close(self) -> None:
        import ray

        self._stop.set()
        self._repair_wanted.set()
        repairer = getattr(self, "_repairer", None)
        if repairer is not None and repairer is not threading.current_thread():
            repairer.join(timeout=REPAIR_JOIN_S)  # its Ray calls end before the caller disconnects
        for actor in getattr(self, "unique_actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                pass


def ray_chain(config: ChainConfig, eos_token_ids: tuple[int, ...]) -> DistributedChain:
    membership = RayMembership(config, eos_token_ids)
    chain = DistributedChain(membership, config.speculation_lengths(), tree_width=config.speculation.tree_width,
                             scheme=config.speculation.verifier, eos_token_ids=eos_token_ids,
                             max_context=membership.max_context, pipeline=config.runtime.pipeline)
    chain.vocab_size = membership.vocab_size
    chain.transport = membership.transport
    return chain
