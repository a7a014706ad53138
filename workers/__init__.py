"""Model-facing layers: the pure decoding math (`core`) and the tiers of a chain (`tiers`)."""
