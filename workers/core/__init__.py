"""Core math: verification rules, draft trees, sampling and KV bookkeeping; plain functions on tensors, no I/O."""
