"""Models available offline, by short name.

``resolve_model("tiny")`` builds (once) and returns the tiny random-init Qwen3 folder;
``resolve_model("smollm2")`` converts (once) SmolLM2-135M-Instruct from its PyPI wheel; any
other string is returned unchanged (a hub id or a local folder). ``SHORT_NAMES`` lists the short
names; ``training/models/resolve.py`` (``check_base_model``) checks a name before anything loads.
A local folder given by a relative path comes back absolute: the launched servers run in the run's
log folder, where the relative path means nothing.
"""

from __future__ import annotations

import os

SHORT_NAMES = ("tiny", "smollm2")
"""The names ``resolve_model`` builds a folder for; any other name is a hub id or a local folder."""


def resolve_model(name: str) -> str:
    """A folder (or hub id) that ``from_pretrained`` loads from any working directory."""
    if name == "tiny":
        from training.models.build_tiny import ensure_tiny_model

        return ensure_tiny_model("qwen3")
    if name == "smollm2":
        from training.models.smollm2 import ensure_smollm2

        return ensure_smollm2()
    folder = os.path.expanduser(name)
    return os.path.abspath(folder) if os.path.isdir(folder) else name
