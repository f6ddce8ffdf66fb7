"""The project's cache folder, and a hub id resolved to its folder in the local Hugging Face cache.

- ``cache_dir()``: ``$TRAINING_CACHE``, else ``~/.cache/training``. Built models (``training/models``: the
  tiny model, converted SmolLM2) and the engine's compiled decode step (``native/``) live under it; both
  floors read the folder from here.
- ``local_model_path(model)``: the engine's lean forward reads a folder's safetensors; given
  ``Qwen/Qwen3-0.6B`` instead of a folder it would take the slow transformers fallback. This turns a hub
  id whose snapshot is already cached (``HF_HUB_CACHE`` / ``HF_HOME``) into that folder, without network.
"""

from __future__ import annotations

from pathlib import Path
import os


def cache_dir() -> Path:
    """Root of the project's cache: ``$TRAINING_CACHE`` or ``~/.cache/training`` (not created here)."""
    return Path(os.environ.get("TRAINING_CACHE", Path.home() / ".cache" / "training"))


def local_model_path(model: str) -> str:
    """``model`` itself when it is a folder (or not a cached hub id); else the cached snapshot folder.

    Nothing is downloaded (``local_files_only``): a hub id that is not cached comes back unchanged,
    and whoever loads it then downloads it as before.
    """
    if Path(model).is_dir():
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception:  # not a valid repo id, or not cached: the caller's loaders decide
        return model
