"""Models available offline, by short name.

``resolve_model("tiny")`` builds (once) and returns the tiny random-init Qwen3 folder;
``resolve_model("smollm2")`` converts (once) SmolLM2-135M-Instruct from its PyPI wheel; any
other string is returned unchanged (a hub id or a local folder). ``SHORT_NAMES`` lists the short
names; ``training/models/resolve.py`` (``check_base_model``) checks a name before anything loads.
"""

from __future__ import annotations

SHORT_NAMES = ("tiny", "smollm2")
"""The names ``resolve_model`` builds a folder for; any other name is a hub id or a local folder."""


def resolve_model(name: str) -> str:
    if name == "tiny":
        from training.models.build_tiny import ensure_tiny_model

        return ensure_tiny_model("qwen3")
    if name == "smollm2":
        from training.models.smollm2 import ensure_smollm2

        return ensure_smollm2()
    return name
