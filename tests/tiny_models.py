"""Tiny random models and a byte-level tokenizer, built in temp folders (nothing downloaded).

A module of its own, not conftest.py: test modules import these by name, and with a
conftest.py in several test folders `from conftest import ...` resolves to whichever was
imported first.
"""

from __future__ import annotations

import torch

EOS = "<|endoftext|>"


def make_tokenizer(extra_tokens: int = 0):
    """Byte-level tokenizer with no merges: 256 byte tokens + EOS (+ `extra_tokens` fillers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    for j in range(extra_tokens):
        vocab[f"<extra_{j}>"] = len(vocab)
    vocab[EOS] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, bos_token=EOS)


def make_model(path, tokenizer, hidden: int, layers: int, seed: int, context: int = 256, init_scale: float = 0.2, base=None, noise: float = 0.0):
    """A random Llama saved with its tokenizer. `base` + `noise`: a perturbed copy of another model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=init_scale,  # larger than the default 0.02: sharper, less tie-prone logits
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    if base is not None:
        model.load_state_dict(base.state_dict())
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(noise * parameter.std() * torch.randn_like(parameter))
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return model
