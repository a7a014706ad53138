"""Control layers: decoding, tuning, distribution, the engine, serving and the CLI."""
