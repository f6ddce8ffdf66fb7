"""Shared fixtures: the tiny model is built once per machine into the cache and reused.

The CPU suite runs on the CPU, also on a machine with GPUs: unless the run selects only the ``gpu``
tests (``pytest -m gpu``), ``CUDA_VISIBLE_DEVICES`` is set to "" before any test touches CUDA, so
every ``device="auto"`` (trainer, engine, launched servers) resolves to the CPU and the fp32
exactness asserts hold. ``tests/test_gpu.py`` holds the GPU suite (``scripts/gpu_suite.sh``).
"""

import os

import pytest

from training.models.build_tiny import ensure_tiny_model


def selects_only_gpu_tests(markexpr: str) -> bool:
    """True when the ``-m`` expression keeps ``gpu``-marked tests and drops unmarked ones (``-m gpu``)."""
    from _pytest.mark.expression import Expression

    if not markexpr.strip():
        return False
    expr = Expression.compile(markexpr)
    return expr.evaluate(lambda name, **kw: name == "gpu") and not expr.evaluate(lambda name, **kw: False)


def pytest_configure(config):
    if not selects_only_gpu_tests(config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU suite: before any test initialises CUDA


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """Folder of the tiny random-init Qwen3 model + tokenizer (a normal HF folder)."""
    return ensure_tiny_model("qwen3")


@pytest.fixture(scope="session")
def tiny_llama_path() -> str:
    """Folder of the tiny random-init Llama model + tokenizer."""
    return ensure_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_teacher_path() -> str:
    """Another tiny Qwen3 with the same tokenizer and other random weights: a distillation teacher for ``tiny``."""
    return ensure_tiny_model("qwen3", weight_seed=1)
