"""The time model, latency profiles and the online tuner that picks speculation lengths and tiers."""
