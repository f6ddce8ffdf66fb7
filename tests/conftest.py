"""Shared fixtures: the tiny model is built once per machine into the cache and reused."""

import pytest

from training.models.build_tiny import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """Folder of the tiny random-init Qwen3 model + tokenizer (a normal HF folder)."""
    return ensure_tiny_model("qwen3")


@pytest.fixture(scope="session")
def tiny_llama_path() -> str:
    """Folder of the tiny random-init Llama model + tokenizer."""
    return ensure_tiny_model("llama")
