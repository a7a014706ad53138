"""Tiers in other processes: the tier worker, the tier-to-tier transport, the driver and the Ray runtime."""
