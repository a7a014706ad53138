"""Experiment harnesses behind `polyspec bench`, `polyspec tune` and `polyspec zoo`; the runtime never imports them."""
