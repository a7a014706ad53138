"""The chain a model-loading command runs, from its flags: `-c CONFIG`, or
`-m MODEL [--draft MODEL ...] [--ngram]` without any YAML, with `--dtype`, `--threads` and
`--device` overriding every model tier of either.

Nothing here imports torch or transformers, so a mistake in the flags or the config (an
unknown key, a missing model folder, an unknown `zoo:` name) is reported in milliseconds,
before any model library loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from polyspec.orchestrator.config import AUTO, DTYPES, QUANTIZE, ChainConfig, check_gguf_quantize, load_config, parse_config, parse_lengths
from polyspec.orchestrator.validate import check_model_paths
from polyspec.workers.core.errors import ConfigError
from polyspec.workers.tiers.model_cache import NGRAM_MODEL

MODEL_HELP = "a Hugging Face id, a model folder, a .gguf file or zoo:NAME"


def add_chain_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the chain: a config file, or models named here")
    group.add_argument("-c", "--config", help="chain config (YAML)")
    group.add_argument("-m", "--model", help=f"the target model, instead of -c: {MODEL_HELP}")
    group.add_argument("--draft", action="append", default=[], metavar="MODEL",
                       help="a drafter model under the target (repeatable: each drafts for the one before)")
    group.add_argument("--ngram", action="store_true", help="with -m: a model-free prompt-lookup drafter as the last tier")
    group.add_argument("--dtype", choices=(*DTYPES, AUTO), default=None,
                       help="every model tier's dtype (overrides the config; auto: measured once per machine)")
    group.add_argument("--quantize", choices=QUANTIZE, default=None,
                       help="the target tier's quantization (overrides the config; gguf: a .gguf target's own blocks on the "
                            "weight-only kernels, the quantized model is then the target)")
    group.add_argument("--threads", type=_threads, default=None,
                       help="torch threads of every model tier, or auto (overrides the config)")
    group.add_argument("--device", default=None, help="every model tier's device: cpu, cuda, cuda:1, auto (overrides the config)")
    group.add_argument("--lengths", default=None, metavar="auto|K[,K...]",
                       help="speculation lengths, one per verifying tier, or auto (the goodput planner; overrides the config)")
    group.add_argument("--reprofile", action="store_true",
                       help="lengths: auto: measure the tiers again instead of reusing this machine's cached profile")


def models_config(target: str, drafts: list[str], ngram: bool) -> ChainConfig:
    """The chain `-m target --draft d1 --draft d2 --ngram` names, as a config would."""
    tiers = [{"name": "target", "model": target}]
    for number, draft in enumerate(drafts, start=1):
        tiers.append({"name": "draft" if len(drafts) == 1 else f"draft{number}", "model": draft})
    if ngram:
        tiers.append({"name": "ngram", "model": NGRAM_MODEL})
    return parse_config({"tiers": tiers})


def with_lengths(config: ChainConfig, text: str) -> ChainConfig:
    """`--lengths auto` or `--lengths 6,3`, checked as the config's speculation.lengths is."""
    if text == "auto":
        lengths = "auto"
    else:
        try:
            lengths = [int(part) for part in text.split(",")]
        except ValueError:
            raise ConfigError(f"--lengths must be auto or integers separated by commas, got {text!r}") from None
    try:
        return dataclasses.replace(config, speculation=dataclasses.replace(config.speculation,
                                                                           lengths=parse_lengths(lengths, len(config.tiers))))
    except ConfigError as exc:
        raise ConfigError(f"--lengths: {str(exc).replace('speculation.lengths ', '')}") from None


def chain_config(args) -> ChainConfig:
    """The ChainConfig the flags name, overrides applied and local model paths checked."""
    if args.config and args.model:
        raise ConfigError("give either -c CONFIG or -m MODEL, not both")
    if args.config:
        if args.draft or args.ngram:
            raise ConfigError("--draft and --ngram build a chain with -m MODEL; with -c the config lists the tiers")
        config = load_config(args.config)
    elif args.model:
        if args.model == NGRAM_MODEL:
            raise ConfigError("-m is the target model and cannot be 'ngram'; add a prompt-lookup drafter with --ngram")
        config = models_config(args.model, args.draft, args.ngram)
    else:
        raise ConfigError(f"no chain given: -c CONFIG (YAML) or -m MODEL ({MODEL_HELP})")
    if args.lengths is not None:
        config = with_lengths(config, args.lengths)
    overrides = {key: value for key, value in (("dtype", args.dtype), ("threads", args.threads), ("device", args.device))
                 if value is not None}
    if overrides:
        tiers = tuple(tier if tier.is_ngram else dataclasses.replace(tier, **overrides) for tier in config.tiers)
        config = dataclasses.replace(config, tiers=tiers)
    quantize = getattr(args, "quantize", None)
    if quantize is not None:
        target = config.tiers[0]
        check_gguf_quantize("--quantize", quantize, target.model)
        group_size = target.group_size if quantize == "int4" else None  # group_size belongs to int4 alone
        config = dataclasses.replace(config, tiers=(dataclasses.replace(target, quantize=quantize, group_size=group_size), *config.tiers[1:]))
    check_model_paths(config)
    if config.runtime.backend != "local" and AUTO in (args.dtype, args.threads):
        raise ConfigError("--dtype / --threads auto are measured in the process that loads the tiers: not with runtime.backend: ray")
    return config


def _threads(text: str):
    if text == AUTO:
        return AUTO
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of threads or auto, got {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {count}")
    return count


def has_chat_template(model: str) -> bool | None:
    """Whether a local model folder ships a chat template, read from its files without loading
    anything (None: not a folder, so only the loaded tokenizer can tell)."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None
