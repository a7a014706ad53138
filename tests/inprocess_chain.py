"""A distributed chain without Ray: loaded tiers served by TierWorkers in this process, wired
over gRPC on loopback (the distributed protocol, tested without starting a cluster)."""

from __future__ import annotations

from polyspec.orchestrator.distributed.driver import DistributedChain, Membership, TierView
from polyspec.orchestrator.distributed.worker import TierWorker


class StaticMembership(Membership):
    """Workers started by the caller, target first (no restarts)."""

    def __init__(self, addresses: list[str], names: list[str]) -> None:
        self.views = [TierView(name, i, address=a) for i, (name, a) in enumerate(zip(names, addresses))]

    def target_address(self) -> str:
        return self.views[0].address


def in_process_chain(tiers, lengths: list[int], *, eos_token_ids=(), tree_width: int = 1, scheme: str = "specinfer",
                     pipeline: bool = False, host: str = "127.0.0.1", device_slots: int = 0,
                     keep_finished: int = 0) -> tuple[DistributedChain, list]:
    """Loaded `tiers` (target first) served by TierWorkers in this process, wired over gRPC on
    loopback: the distributed protocol without Ray. `device_slots`: each model tier serves batched
    calls as a device tier of that many requests (as a Ray actor does with `batching.round: device`).
    `keep_finished`: finished requests whose caches stay in the workers (prefix reuse).
    Returns the chain and the workers (stop them with `worker.stop()`)."""
    workers = [TierWorker(tier, i, eos_token_ids=eos_token_ids, host=host, device_slots=device_slots if tier.has_weights else 0,
                          device_context=256 if device_slots else None) for i, tier in enumerate(tiers)]
    for upper, lower in zip(reversed(workers[:-1]), reversed(workers[1:])):
        upper.connect(lower.address)
    contexts = [t.max_context for t in tiers if t.max_context]
    membership = StaticMembership([w.address for w in workers], [t.name for t in tiers])
    for view, tier in zip(membership.views, tiers):
        view.vocab_size, view.max_context = tier.vocab_size, tier.max_context
    chain = DistributedChain(membership, lengths, tree_width=tree_width, scheme=scheme, eos_token_ids=tuple(eos_token_ids),
                             max_context=min(contexts) if contexts else None, pipeline=pipeline, keep_finished=keep_finished)
    return chain, workers
