"""The tiers of a chain: the `Tier` interface, model and n-gram tiers, and loading them from a config."""
