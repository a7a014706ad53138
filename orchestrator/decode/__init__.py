"""The chain scheduler: staged speculative decoding over `Tier` objects, with a public round API."""
