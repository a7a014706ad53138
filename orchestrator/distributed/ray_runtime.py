"""`runtime.backend: ray`: one Ray actor per tier, on one node or many.

Ray owns placement, lifecycle and restarts; the data plane is the tier-to-tier gRPC protocol
served by each actor's TierWorker on its node's address (polyspec.orchestrator.distributed.worker), and the
driver is polyspec.orchestrator.distributed.driver.DistributedChain. This module:

- checks the cluster can place every tier before asking (a target whose resources no node
  has is an error naming the tier and the resource, not a hang; such a drafter is left out);
- starts the chain without a drafter that cannot be placed or dies while the chain starts
  (only the target must start), and says so (stderr, `events`);
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
  and inline gRPC on CPU, see polyspec.orchestrator.distributed.transport for the measurements behind that).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from polyspec.orchestrator.distributed import cluster_auth
from polyspec.orchestrator.config import ChainConfig
from polyspec.orchestrator.distributed.driver import ChainUnavailableError, DistributedChain, Membership, TierView
from polyspec.orchestrator.distributed.transport import health
from polyspec.workers.core.errors import ConfigError, PolyspecError

START_TIMEOUT_S = float(os.environ.get("POLYSPEC_RAY_START_TIMEOUT_S", "180"))
RESTART_TIMEOUT_S = float(os.environ.get("POLYSPEC_RAY_RESTART_TIMEOUT_S", "180"))
REPAIR_PERIOD_S = 1.0
PING_TIMEOUT_S = 2.0  # a tier that does not answer Health within this is down
START_POLL_S = 0.5  # how often start-up looks again at the actors not up yet and at the live nodes
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


def device_slots(tier, batching) -> int:
    """How many requests a tier actor's model tier holds when it decodes in static steps (`BatchedModelTier`'s
    `steps`): the chain's `batching.max_requests` where `batching.round` says so (device; auto: on CUDA),
    else 0 (the ragged forward, its pool's own bound)."""
    from polyspec.workers.tiers.tier import NGramTier

    mode = batching.round
    if mode == "ragged" or isinstance(tier, NGramTier):
        return 0
    on_cuda = str(tier.device).startswith("cuda")
    return batching.max_requests + 1 if (mode == "device" or on_cuda) else 0  # + 1: a profile's sequence


def actor_device_slots(tiers, batching) -> list[int]:
    """`device_slots` of each tier an actor hosts (its own tier, then its trained drafters): an early-exit drafter's
    device tier has a pool of its own beside its target's (their weights shared); a feature head reads its target's
    ragged cache, so an actor hosting one serves each of its tiers ragged."""
    from polyspec.workers.tiers.feature_tier import FeatureTier

    if any(isinstance(tier, FeatureTier) for tier in tiers):
        return [0] * len(tiers)
    return [device_slots(tier, batching) for tier in tiers]


class TierActor:
    """The body of a tier's Ray actor: loads its tiers and serves them (a restart re-runs this).
    `tier_configs[0]` is the actor's own tier; the rest are trained drafters over it."""

    def __init__(self, tier_configs, indices: list[int], eos_token_ids: tuple[int, ...], threads: int, batching=None) -> None:
        """`batching` (the chain's BatchingConfig): its `round` decides whether the actor's model tier serves
        batched rounds as a device tier (`actor_device_slots`)."""
        import ray
        import torch

        from polyspec.orchestrator.distributed.model_lock import LockedTiers, ModelLock
        from polyspec.workers.tiers.loading import freeze_heap, load_drafter_tier, load_model_tier, quiet_transformers
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
        host = ray.util.get_node_ip_address()
        # each tier's device slots: a target and its early-exit drafter both on the device, a feature head's actor ragged
        slots = actor_device_slots(tiers, batching)
        # one model lock, and batched tiers made together: a feature head reads its target's slot cache
        # a ragged tier's pool: every request's sequence, its scoring scratch sequence and a profile's
        ragged = 2 * batching.max_requests + 2 if batching is not None else None
        siblings = LockedTiers(tiers, ModelLock(), slots, batching.max_context, ragged)
        self.workers = {index: TierWorker(tier, index, eos_token_ids=eos_token_ids, host=host, siblings=siblings)
                        for index, tier in zip(indices, tiers)}
        self.first = indices[0]
        self.node_id = ray.get_runtime_context().get_node_id()
        freeze_heap()  # (the actor's process serves this chain alone until it stops)

    def info(self, index: int | None = None) -> dict:
        worker = self.workers[self.first if index is None else index]
        tier = worker.tier
        return {"address": worker.address, "out_features": self.out_features, "max_context": tier.max_context,
                "node_id": self.node_id, "pid": os.getpid(), "device": str(tier.device)}

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


def check_placement(config: ChainConfig, nodes: list[dict]) -> tuple[list[dict], dict[int, str]]:
    """Each tier's resource demand, and the drafters no live node can hold now (tier index ->
    why, one line). A target no live node can hold is a ConfigError naming the tier and the
    resource: the chain cannot run without it. A drafter that cannot be placed is not an
    error: the chain starts without it (RayMembership) and adds it once a node can hold it."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    gpus = sum(n.get("Resources", {}).get("GPU", 0) for n in alive)
    needs = _requirements(config, gpus)
    unplaced = {}
    for index, (tier, need) in enumerate(zip(config.tiers, needs)):
        if tier.drafter:
            continue  # placed with its target (actor_groups)
        why = _unplaceable(tier.name, need, alive)
        if why is None:
            continue
        if index == 0:
            raise ConfigError(why)
        unplaced[index] = why
    return needs, unplaced


def _unplaceable(name: str, need: dict, alive: list[dict]) -> str | None:
    """Why no node in `alive` can hold a tier needing `need` (None: one can)."""
    if any(all(n.get("Resources", {}).get(r, 0) >= amount for r, amount in need.items()) for n in alive):
        return None
    missing = next((r for r, amount in need.items() if not any(n.get("Resources", {}).get(r, 0) >= amount for n in alive)), None)
    known = sorted({r for n in alive for r in n.get("Resources", {}) if not r.startswith("node:") and "memory" not in r})
    if missing is not None:
        return (f"tier {name!r} cannot be placed: no node in the Ray cluster has resource {missing!r} "
                f">= {need[missing]:g} (the cluster has: {', '.join(known)})")
    return f"tier {name!r} cannot be placed: no single node has all of {need}"


def _say(message: str) -> None:
    """A membership change, on the driver's stderr as the CLI's other lines (and in runtime_stats' `tier_events`)."""
    print(f"polyspec: {message}", file=sys.stderr, flush=True)


class RayMembership(Membership):
    def __init__(self, config: ChainConfig, eos_token_ids: tuple[int, ...]) -> None:
        import ray

        self.config = config
        runtime = config.runtime
        _init_ray(runtime.address, len(config.tiers))
        self.started_at = time.monotonic()
        self.events: list[dict] = []  # membership changes: runtime_stats' `tier_events`
        needs, unplaced = check_placement(config, ray.nodes())
        self.needs = needs
        self.views = [TierView(t.name, i) for i, t in enumerate(config.tiers)]
        self.groups = actor_groups(config)
        self._lock = threading.RLock()
        self._pending: dict[int, object] = {}  # tier -> in-flight info() of a restarting actor
        self._refused: dict[int, str] = {}  # tier -> why its (re)started actor cannot join this chain
        self._stop = threading.Event()
        self._repair_wanted = threading.Event()
        self.placement_group = None
        strategies = [None] * len(self.groups)
        if runtime.placement == "spread" and len(self.groups) > 1:
            strategies = self._spread(unplaced)
        actor_cls = ray.remote(TierActor)
        self.actors = [None] * len(config.tiers)  # per tier: its actor (co-located tiers share one)
        self.unique_actors = []
        for g, group in enumerate(self.groups):
            tier, need = config.tiers[group[0]], needs[group[0]]
            custom = {k: v for k, v in need.items() if k not in ("CPU", "GPU")}
            # An unplaceable drafter's actor is still asked for: Ray keeps it pending and
            # places it when a node with its resources joins; the repair loop then wires it in.
            options = dict(num_cpus=need.get("CPU", 0), num_gpus=need.get("GPU", 0), resources=custom or None,
                           max_restarts=-1, max_task_retries=0, max_concurrency=4, name=None,
                           runtime_env=cluster_auth.actor_runtime_env())  # the chain's cluster token
            if strategies[g] is not None:
                options["scheduling_strategy"] = strategies[g]
            threads = tier.threads or 1
            actor = actor_cls.options(**options).remote([config.tiers[i] for i in group], group, tuple(eos_token_ids), threads,
                                                        config.batching)
            self.unique_actors.append(actor)
            for i in group:
                self.actors[i] = actor
        infos = self._wait_infos(unplaced)
        models = [info["out_features"] for info in infos if info and info["out_features"]]
        self.vocab_size = min(models)
        contexts = [info["max_context"] for info in infos if info and info["max_context"]]
        self.max_context = min(contexts) if contexts else None
        setups = {g: self.unique_actors[g].setup.remote(self.vocab_size) for g, group in enumerate(self.groups)
                  if infos[group[0]] is not None}
        for g, ref in setups.items():
            try:
                ray.get(ref, timeout=30)
            except Exception as exc:  # noqa: BLE001 - a drafter lost between its info() and now is left out too
                if g == 0:
                    self.close()
                    raise ConfigError(f"tier {config.tiers[0].name!r} failed to start: {str(exc).strip().splitlines()[0]}") from None
                for i in self.groups[g]:
                    infos[i] = None
                    self._event(i, "left_out", "died while the chain was starting: the chain starts without it "
                                               "and adds it when its actor is up")
        for view, info in zip(self.views, infos):
            view.vocab_size = self.vocab_size
            if info is None:
                view.up = False  # bypassed: _wire skips it, the repair loop adds it when its actor answers
                continue
            view.address, view.max_context = info["address"], info["max_context"]
        self._wire()
        self.transport = self._join_dist(infos)
        self._repairer = threading.Thread(target=self._repair_loop, name="polyspec-ray-repair", daemon=True)
        self._repairer.start()

    def _spread(self, unplaced: dict[int, str]) -> list:
        """`placement: spread`: a STRICT_SPREAD placement group, one bundle per actor; each
        actor's scheduling strategy (None: outside the group). A group is placed whole or not at
        all, so a drafter no live node can hold (now, or once a node Ray still listed alive at
        the check is found dead) is kept out of it, and its actor, pinned by its resources
        alone, is placed when such a node joins. `unplaced` grows with such drafters."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            spread = [g for g, group in enumerate(self.groups) if group[0] not in unplaced]
            bundles = [dict(self.needs[self.groups[g][0]]) for g in spread]
            self.placement_group = placement_group(bundles, strategy="STRICT_SPREAD")
            while True:
                ready, _ = ray.wait([self.placement_group.ready()], timeout=START_POLL_S)
                if ready:
                    strategies = [None] * len(self.groups)
                    for b, g in enumerate(spread):
                        strategies[g] = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=b)
                    return strategies
                try:
                    if time.monotonic() > deadline:
                        raise ConfigError(f"runtime.placement: spread needs {len(bundles)} nodes with {bundles}; "
                                          "the cluster cannot place them")
                    _, now = check_placement(self.config, ray.nodes())  # a target no node can hold: ConfigError
                except ConfigError:
                    remove_placement_group(self.placement_group)  # no actor will use it
                    self.placement_group = None
                    raise
                if set(now) - set(unplaced):
                    break
            unplaced.update(now)
            remove_placement_group(self.placement_group)  # and ask again without them

    def _event(self, tier: int, event: str, reason: str) -> None:
        """Record (and print) a change of the chain's membership."""
        self.events.append({"at_s": round(time.monotonic() - self.started_at, 3), "tier": self.views[tier].name,
                            "event": event, "reason": reason})
        _say(f"tier {self.views[tier].name!r} {reason}")

    # ----------------------------------------------------------------- startup

    def _wait_infos(self, unplaced: dict[int, str]) -> list[dict | None]:
        """Each tier's info() once its actor is up; None for a drafter the chain starts without.

        The target's actor (and the trained drafters in it) must start: while some live node
        can hold it a death is a restart to wait for; once no live node can, or after
        START_TIMEOUT_S, it is a ConfigError naming the tier. A drafter that cannot be placed,
        whose actor or node dies before it answers, or that is not up within START_TIMEOUT_S,
        is left out: the chain runs without it, as without a drafter lost mid-run, and the
        repair loop wires it in once its actor (which Ray keeps restarting) answers."""
        import ray

        tiers = self.config.tiers
        target_group = set(self.groups[0])
        refs = {i: actor.info.remote(i) for i, actor in enumerate(self.actors)}
        infos: list[dict | None] = [None] * len(tiers)
        left_out = dict(unplaced)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            waiting = [i for i in refs if infos[i] is None and i not in left_out]
            if not waiting:
                break
            ready, _ = ray.wait([refs[i] for i in waiting], num_returns=len(waiting), timeout=START_POLL_S)
            for i in waiting:
                if refs[i] not in ready:
                    continue
                try:
                    infos[i] = ray.get(refs[i])
                except ray.exceptions.RayActorError as exc:
                    if getattr(exc, "actor_init_failed", False):
                        self._start_failed(tiers[i].name, exc)
                    if i in target_group:
                        refs[i] = self.actors[i].info.remote(i)  # Ray restarts it (max_restarts): ask the new one
                        time.sleep(START_POLL_S)  # (a dead actor answers at once: no busy loop)
                    else:
                        left_out[i] = f"tier {tiers[i].name!r} died while the chain was starting (its actor or its node)"
                except Exception as exc:  # noqa: BLE001 - the actor's constructor failed: a ModelLoadError, say
                    self._start_failed(tiers[i].name, exc)
            waiting = [i for i in waiting if infos[i] is None and i not in left_out]
            if not waiting:
                break
            # A tier whose node left (Ray lists it dead) waits for a node that can hold it: none
            # may come, so the target fails now and a drafter is left out (the repair loop adds it later).
            alive = [n for n in ray.nodes() if n.get("Alive")]
            for i in waiting:
                group = next(g for g in self.groups if i in g)
                why = _unplaceable(tiers[group[0]].name, self.needs[group[0]], alive)
                if why is None:
                    continue
                why += "; its node left while the chain was starting"
                if i in target_group:
                    self.close()
                    raise ConfigError(why) from None
                left_out[i] = why
            if time.monotonic() > deadline:
                stuck = [tiers[i].name for i in waiting if i in target_group]
                if stuck:
                    self.close()
                    raise ConfigError(f"tier(s) {', '.join(map(repr, stuck))} did not start within {START_TIMEOUT_S:g}s "
                                      "(the cluster has no free node with the resources they ask for, or their model is still loading)")
                for i in waiting:
                    left_out[i] = f"tier {tiers[i].name!r} did not start within {START_TIMEOUT_S:g}s"
        for i, why in sorted(left_out.items()):
            self._event(i, "left_out", f"{why.removeprefix(f'tier {tiers[i].name!r} ')}: the chain starts without it "
                                       "and adds it when its actor is up")
        return infos

    def _start_failed(self, name: str, exc: Exception) -> None:
        """A tier's actor raised in its constructor (a model that does not load, say): one line, whatever the tier."""
        self.close()
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, PolyspecError):
            raise type(cause)(str(cause)) from None
        raise ConfigError(f"tier {name!r} failed to start: {str(cause).strip().splitlines()[-1]}") from None

    def _join_dist(self, infos: list[dict | None]) -> str:
        import ray

        wanted = self.config.runtime.tensor_transport
        if any(info is None for info in infos):
            # the group is fixed at start-up and a tier joining later cannot enter it: rows go inline
            if wanted in ("nccl", "gloo"):
                _say(f"tensor_transport: {wanted} needs every tier up at start-up; rows go inline in the gRPC messages")
            return "grpc"
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
                if info["address"] == self.views[0].address and health(info["address"], PING_TIMEOUT_S) is not None:
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
                if view.up and health(view.address, PING_TIMEOUT_S) is None:
                    view.up = False
                    self._event(i, "down", "is down: bypassed until Ray restarts its actor")
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
                        refused = self._refusal(info)
                        if refused:
                            if self._refused.get(i) != refused:  # said once per actor, not every second
                                self._refused[i] = refused
                                self._event(i, "refused", refused)
                            continue
                        ray.get(self.actors[i].setup.remote(self.vocab_size), timeout=30)
                    except Exception:  # noqa: BLE001 - still restarting (or gone for good): try again later
                        continue
                    if health(info["address"], PING_TIMEOUT_S) is not None:
                        view.address, view.max_context, view.up = info["address"], info["max_context"], True
                        self._refused.pop(i, None)
                        self._event(i, "up", "is up: wired into the chain")
                        changed = True
            if changed:
                self._wire()

    def _refusal(self, info: dict) -> str:
        """Why a tier that started after the chain cannot join it ('' if it can): the chain's
        vocabulary and context limit were fixed from the tiers up at start-up."""
        if info["out_features"] and info["out_features"] < self.vocab_size:
            return f"cannot join: its vocabulary ({info['out_features']}) is smaller than the chain's ({self.vocab_size})"
        if info["max_context"] and (self.max_context is None or info["max_context"] < self.max_context):
            return f"cannot join: its context limit ({info['max_context']}) is below the chain's ({self.max_context or 'none'})"
        return ""

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


def ray_chain(config: ChainConfig, eos_token_ids: tuple[int, ...], keep_finished: int = 0) -> DistributedChain:
    membership = RayMembership(config, eos_token_ids)
    chain = DistributedChain(membership, config.speculation_lengths(), tree_width=config.speculation.tree_width,
                             scheme=config.speculation.verifier, eos_token_ids=eos_token_ids,
                             max_context=membership.max_context, pipeline=config.runtime.pipeline, keep_finished=keep_finished)
    chain.vocab_size = membership.vocab_size
    chain.transport = membership.transport
    return chain
