"""Chains of the tiny test family (tests/conftest.py) by member name, shared by the tests.

"target", "mid", "small" are model directories of the family; "int8" / "fp8" is the target with
`quantize: int8` / `quantize: fp8`; "ngram" is the model-free prompt-lookup tier (named "ng"). With the `tiny_drafters`
family, "feature" is a feature head and "early_exit" / "early_exit_noisy" early-exit
drafters over the target (exit threshold 0.3).
"""

from __future__ import annotations


def tier_specs(family: dict, names) -> list[dict]:
    """The `tiers:` list of a chain config for `names`, target first."""
    specs = []
    for name in names:
        if name in ("int8", "fp8"):
            specs.append({"name": name, "model": family["target"], "quantize": name})
        elif name == "ngram":
            specs.append({"name": "ng", "model": "ngram"})
        elif name == "feature":
            specs.append({"name": name, "model": {"feature_head": family[name]}})
        elif name.startswith("early_exit"):
            specs.append({"name": name, "model": {"early_exit": family[name], "layers": 1, "exit_threshold": 0.3}})
        else:
            specs.append({"name": name, "model": family[name]})
    return specs
