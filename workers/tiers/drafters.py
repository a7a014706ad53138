"""Trained drafters that share the target's weights or features, and their checkpoints.

Two kinds, both trained by `polyspec train-draft` (polyspec.harness.train_draft), described in
docs/drafters.md: a **feature** head (EAGLE / FSPAD: one decoder layer over the target's last hidden
states, with FSPAD's feature sampling and partial alignment as options) and an **early_exit**
adapter (Kangaroo: the target's first L layers, shared, plus one trained layer and norm before its LM
head, so it runs as an ordinary model tier of L + 1 layers). A checkpoint is a directory holding
`drafter.json` (kind, shape, the target it was trained for, training record) and
`model.safetensors` (the trained weights only).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from polyspec.workers.core.errors import ModelLoadError

DRAFTER_FILE = "drafter.json"
WEIGHTS_FILE = "model.safetensors"
KINDS = ("feature", "early_exit")


class DrafterError(ModelLoadError):
    """A drafter checkpoint that is missing, malformed, or made for another target."""


def target_signature(config) -> dict:
    """What a drafter checkpoint records of its target, checked when it is loaded."""
    return {
        "model_type": getattr(config, "model_type", None),
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
    }


def head_config(target_config, intermediate_size: int | None = None, layers: int = 1):
    """A Llama config for drafter layers shaped like the target's (attention heads, RoPE, norm eps)."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = layers
    if intermediate_size:
        config.intermediate_size = intermediate_size
    config.use_cache = True
    return config


class FeatureHead(nn.Module):
    """One decoder layer from (target feature at p-1, embedding of token p) to the target's feature at p."""

    def __init__(self, config, sampling: bool = True, decoupled: bool = True) -> None:
        from transformers import LlamaModel
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.sampling = sampling
        self.decoupled = decoupled
        self.fc = nn.Linear((3 if sampling else 2) * hidden, hidden, bias=True)
        small = copy.deepcopy(config)
        small.vocab_size = 1  # inputs arrive as embeddings; the unused token table stays tiny
        small.pad_token_id = None
        self.decoder = LlamaModel(small)
        self.decoder.norm = nn.Identity()  # the two output norms below read the layer's raw output
        self.feature_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        if decoupled:
            self.logit_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.logit_adapter = nn.Linear(hidden, hidden, bias=False)
            nn.init.zeros_(self.logit_adapter.weight)

    def forward(self, features, embeds, position_ids, cache=None, attention_mask=None):
        """features, embeds: [B, T, H]; returns (predicted features [B, T, H], the LM head's input [B, T, H])."""
        parts = [features, embeds] + ([features * embeds] if self.sampling else [])
        x = self.fc(torch.cat(parts, dim=-1))
        # the cache goes positionally: transformers 5.x renames its keyword (past_key_values -> cache)
        out = self.decoder(None, attention_mask, position_ids, cache, x, use_cache=cache is not None)
        return self.outputs(out.last_hidden_state)

    def outputs(self, trunk):
        """The layer's raw output -> (predicted feature, the LM head's input)."""
        feature = self.feature_norm(trunk)
        if not self.decoupled:
            return feature, feature
        logit_input = self.logit_norm(trunk)
        return feature, logit_input + self.logit_adapter(logit_input)


class EarlyExitAdapter(nn.Module):
    """Kangaroo's adapter: one decoder layer and a norm between the target's layer L and its LM head."""

    def __init__(self, config, layers: int) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

        super().__init__()
        self.layer = LlamaDecoderLayer(config, layer_idx=layers)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def early_exit_model(target_model, layers: int, adapter: EarlyExitAdapter):
    """A `LlamaForCausalLM` of L + 1 layers whose first L layers, embeddings, rotary table
    and LM head ARE the target's modules (no copy): the target's first layers and the adapter."""
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = layers + 1
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    base, target_base = model.model, target_model.model
    base.embed_tokens = target_base.embed_tokens
    base.rotary_emb = target_base.rotary_emb
    base.layers = nn.ModuleList([*target_base.layers[:layers], adapter.layer])
    base.norm = adapter.norm
    model.lm_head = target_model.lm_head
    return model.eval()


# ------------------------------------------------------------------------ checkpoints


def save_drafter(directory, kind: str, module: nn.Module, meta: dict, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `drafter.json` and the module's weights into `directory` (bfloat16 by default, as
    the demo family's models: the tier loads them into the target's dtype)."""
    from safetensors.torch import save_file

    if kind not in KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in module.state_dict().items() if not k.startswith("decoder.embed_tokens")}
    save_file(state, str(path / WEIGHTS_FILE))
    (path / DRAFTER_FILE).write_text(json.dumps({"kind": kind, **meta}, indent=2) + "\n")


def read_drafter_meta(directory) -> dict:
    path = Path(directory) / DRAFTER_FILE
    if not path.exists():
        raise DrafterError(f"{directory} is not a drafter checkpoint (no {DRAFTER_FILE}; train one with `polyspec train-draft`)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DrafterError(f"{path} is not valid JSON: {exc}") from None
    if meta.get("kind") not in KINDS:
        raise DrafterError(f"{path}: kind must be one of {', '.join(KINDS)}, got {meta.get('kind')!r}")
    return meta


def check_target(meta: dict, target_config, where: str) -> None:
    expected = target_signature(target_config)
    recorded = meta.get("target") or {}
    differing = [k for k in expected if recorded.get(k) != expected[k]]
    if differing:
        key = differing[0]
        raise DrafterError(f"{where} was trained for another target ({key} {recorded.get(key)!r}, this target has {expected[key]!r})")


def _load_weights(module: nn.Module, directory, where: str) -> None:
    from safetensors.torch import load_file

    weights = Path(directory) / WEIGHTS_FILE
    if not weights.exists():
        raise DrafterError(f"{where}: {weights} is missing")
    state = load_file(str(weights))
    own = {k: v.shape for k, v in module.state_dict().items() if not k.startswith("decoder.embed_tokens")}
    differing = sorted(set(own) ^ set(state)) or sorted(k for k in own if state[k].shape != own[k])
    if differing:
        raise DrafterError(f"{where}: the weights in {weights} do not match the drafter's shape (e.g. {differing[0]!r})")
    module.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)


def build_feature_head(meta: dict, target_config) -> FeatureHead:
    return FeatureHead(
        head_config(target_config, meta.get("intermediate_size")), sampling=bool(meta.get("sampling", True)), decoupled=bool(meta.get("decoupled", True))
    )


def build_adapter(meta: dict, target_config) -> EarlyExitAdapter:
    return EarlyExitAdapter(head_config(target_config, meta.get("intermediate_size"), layers=int(meta["layers"]) + 1), int(meta["layers"]))


def load_feature_head(directory, target_model, where: str) -> tuple[FeatureHead, dict]:
    meta = read_drafter_meta(directory)
    if meta["kind"] != "feature":
        raise DrafterError(f"{where}: {directory} holds an {meta['kind']} drafter, not a feature head")
    check_target(meta, target_model.config, where)
    head = build_feature_head(meta, target_model.config)
    _load_weights(head, directory, where)
    dtype = next(target_model.parameters()).dtype
    return head.to(dtype if dtype.is_floating_point else torch.float32).eval(), meta


def load_early_exit(directory, target_model, layers: int | None, where: str):
    """The early-exit model over `target_model` (its first L layers shared) and the checkpoint's meta."""
    meta = read_drafter_meta(directory)
    if meta["kind"] != "early_exit":
        raise DrafterError(f"{where}: {directory} holds a {meta['kind']} drafter, not an early-exit adapter")
    check_target(meta, target_model.config, where)
    trained = int(meta["layers"])
    if layers is not None and layers != trained:
        raise DrafterError(f"{where}: layers is {layers} but the adapter in {directory} was trained over the target's first {trained} layers")
    adapter = build_adapter(meta, target_model.config)
    _load_weights(adapter, directory, where)
    weight = next(target_model.parameters())
    # on the target's device (a GPU target's shared layers stay there), in its dtype (float32 beside a quantized one)
    adapter = adapter.to(device=weight.device, dtype=weight.dtype if weight.dtype.is_floating_point else torch.float32)
    return early_exit_model(target_model, trained, adapter), meta


def new_drafter(kind: str, target_model, *, layers: int = 2, sampling: bool = True, decoupled: bool = True, intermediate_size: int | None = None):
    """An untrained drafter for `target_model` and its checkpoint meta. The early-exit adapter
    starts as a copy of the target's next layer and final norm (its layer L+1 reads layer L's
    output); the feature head starts random."""
    config = target_model.config
    meta = {"target": target_signature(config), "intermediate_size": intermediate_size or config.intermediate_size}
    if kind == "feature":
        meta.update(sampling=sampling, decoupled=decoupled)
        head = build_feature_head(meta, config)
        if meta["intermediate_size"] == config.intermediate_size:
            _warm_start_feature_head(head, target_model)
        return head, meta
    if kind != "early_exit":
        raise ValueError(f"unknown drafter kind {kind!r}")
    if not 1 <= layers < config.num_hidden_layers:
        raise ValueError(f"an early-exit drafter reads 1 to {config.num_hidden_layers - 1} of the target's layers, got {layers}")
    meta["layers"] = layers
    adapter = build_adapter(meta, config)
    if meta["intermediate_size"] == config.intermediate_size:
        adapter.layer.load_state_dict(target_model.model.layers[layers].state_dict())
    adapter.norm.load_state_dict(target_model.model.norm.state_dict())
    return adapter, meta


@torch.no_grad()
def _warm_start_feature_head(head: FeatureHead, target_model) -> None:
    """Start as the target's first layer over the token embedding, then its final norm and LM
    head: a one-layer language model, already a drafter, to which training adds the features.
    (The fc passes the embedding through; the feature inputs start at a small random weight.)"""
    hidden = head.config.hidden_size
    weight = head.fc.weight  # [H, k * H]: features, embedding, (features * embedding)
    weight.mul_(0.1)
    weight[:, hidden : 2 * hidden] = torch.eye(hidden)
    head.fc.bias.zero_()
    head.decoder.layers[0].load_state_dict(target_model.model.layers[0].state_dict())
    head.feature_norm.load_state_dict(target_model.model.norm.state_dict())
    if head.decoupled:
        head.logit_norm.load_state_dict(target_model.model.norm.state_dict())
