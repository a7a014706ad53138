"""A model from a GGUF stops on every end-of-generation token: the file's EOS / EOT ids, the tokens whose text
llama.cpp ends a generation on (Qwen: `<|endoftext|>` besides the `<|im_end|>` the file names), and, for a
`zoo fetch`ed model, the upstream generation config's. Offline: a tiny GGUF holding only a vocabulary."""

from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig

from polyspec.harness import zoo_fetch
from polyspec.workers.tiers import loading

gguf = pytest.importorskip("gguf")

VOCABULARY = ["a", "b", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "c", "<|fim_pad|>", "<|endoftext|>x"]
ENDOFTEXT, IM_END, FIM_PAD = 2, 4, 6


def write_vocabulary_gguf(path, eos: int, eot: int | None = None) -> str:
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(VOCABULARY)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(VOCABULARY))
    writer.add_eos_token_id(eos)
    writer.add_bos_token_id(ENDOFTEXT)
    if eot is not None:
        writer.add_eot_token_id(eot)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_the_files_eos_and_llama_cpps_end_of_generation_tokens(tmp_path):
    path = write_vocabulary_gguf(tmp_path / "vocab.gguf", eos=IM_END)
    assert loading.gguf_stop_token_ids(path) == (ENDOFTEXT, IM_END, FIM_PAD)


def test_an_eot_id_in_the_metadata_counts(tmp_path):
    path = write_vocabulary_gguf(tmp_path / "vocab.gguf", eos=IM_END, eot=5)
    assert 5 in loading.gguf_stop_token_ids(path)


def test_adding_stop_ids_keeps_the_first_and_adds_each_once():
    config = GenerationConfig(eos_token_id=IM_END)
    loading.add_stop_token_ids(config, [ENDOFTEXT, IM_END])
    assert config.eos_token_id == [IM_END, ENDOFTEXT]
    unchanged = GenerationConfig(eos_token_id=IM_END)
    loading.add_stop_token_ids(unchanged, [IM_END])
    assert unchanged.eos_token_id == IM_END


def test_zoo_fetch_completes_a_folder_converted_with_one_eos(tmp_path):
    """A folder converted before this fix names only the file's EOS; `zoo fetch` again fixes it in place."""
    folder = tmp_path / "model"
    GenerationConfig(eos_token_id=IM_END, bos_token_id=ENDOFTEXT).save_pretrained(str(folder))
    model = zoo_fetch.ZooModel("fake", "a test model", "vocab.gguf", (), 0, "", tie_lm_head=True, stop_token_ids=(IM_END, 99))
    write_vocabulary_gguf(tmp_path / "vocab.gguf", eos=IM_END)
    assert zoo_fetch.complete_stop_tokens(model, folder, tmp_path / "vocab.gguf")
    stops = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    assert stops[0] == IM_END and sorted(stops) == sorted([IM_END, ENDOFTEXT, FIM_PAD, 99])
    assert not zoo_fetch.complete_stop_tokens(model, folder, tmp_path / "vocab.gguf")  # idempotent


def test_the_qwen_zoo_models_name_both_upstream_stops():
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        assert set(zoo_fetch.MODELS[name].stop_token_ids) == {151643, 151645}
