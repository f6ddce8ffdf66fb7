"""Reading safetensors checkpoints and validating a weight update before anything is swapped.

Names are the checkpoint's own (``model.layers.0.self_attn.q_proj.weight``...). Only
safetensors is read (never pickle). A tied ``lm_head.weight`` is not stored in the files; an
update may still carry it (a trainer's ``state_dict()`` does) if it equals the embedding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from training.deployment.engine.requests import WeightUpdateError

TIED_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a folder (sorted), or the one file ``path`` names."""
    p = Path(path)
    if p.is_file():
        return [p]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {p}")
    return files


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor in the checkpoint, read from headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors folder (or file) on CPU."""
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        tensors.update(load_file(str(f), device="cpu"))
    return tensors


def validate_update(
    tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], tied: bool
) -> dict[str, torch.Tensor]:
    """Check that ``tensors`` is a full, shape-matching set; return it without a redundant tied head.

    Raises :class:`WeightUpdateError` naming the first missing, extra or mismatched tensor.
    """
    out = dict(tensors)
    if tied and TIED_HEAD in out and TIED_HEAD not in expected:
        head = out.pop(TIED_HEAD)
        emb = out.get(EMBED)
        if emb is None or head.shape != emb.shape or not torch.equal(head.cpu(), emb.cpu()):
            raise WeightUpdateError(
                f"{TIED_HEAD}: the model ties it to {EMBED}, but the update gives a different tensor"
            )
    missing = sorted(set(expected) - set(out))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightUpdateError(f"{missing[0]}: missing from the update{more}; a full set is required")
    extra = sorted(set(out) - set(expected))
    if extra:
        raise WeightUpdateError(f"{extra[0]}: not a weight of this model")
    for name, shape in expected.items():
        t = out[name]
        if not isinstance(t, torch.Tensor):
            raise WeightUpdateError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(shape):
            raise WeightUpdateError(f"{name}: shape {tuple(t.shape)} does not match the model's {tuple(shape)}")
        if not (t.is_floating_point()):
            raise WeightUpdateError(f"{name}: dtype {t.dtype} is not a floating-point type")
    return out
