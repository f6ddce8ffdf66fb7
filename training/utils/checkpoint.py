"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizer, recipe state.

Layout under ``<log_path>/checkpoints``::

    step_000010/   .metadata, *.distcp (DCP), recipe_state.json
    latest         the name of the newest complete checkpoint folder

A checkpoint is written into ``step_XXXXXX.tmp`` and renamed once complete, and ``latest`` is
replaced atomically after that, so a crash mid-write leaves the previous checkpoint usable.

Under ``torchrun`` both functions are collectives (every rank calls them with the same path):
``get_state_dict`` gives each rank its FSDP2 shards and DCP writes one ``.distcp`` file per
rank; rank 0 alone writes ``recipe_state.json``, renames folders and prunes old ones. DCP
reshards on load, so a checkpoint written by N ranks loads into M ranks, or into a plain
single-process model (and the other way round).

Only trainable parameters are stored (``ignore_frozen_params``): every weight in full
fine-tuning, the adapters with LoRA (the frozen base weights come from ``base_model`` again on
resume), with the optimizer state of each.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from training.utils.dist import barrier, is_main_rank

RECIPE_STATE = "recipe_state.json"
_TRAINABLE = StateDictOptions(ignore_frozen_params=True)
"""What a checkpoint holds of the model: the parameters that train (frozen ones are reloaded from the base model)."""
_LOAD_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading them: the frozen parameters are absent on purpose (``dcp.load`` itself fails on a trainable one missing)."""


def _quiet():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    return ctx


def _trainable_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``get_state_dict`` without frozen parameters, also under their tied aliases (a tied ``lm_head``)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    recipe_state: Optional[dict],
    keep_last: int = 2,
) -> Path:
    """Write checkpoint ``step`` and point ``latest`` at it; keep the newest ``keep_last``.

    ``recipe_state`` is required on rank 0 and ignored on the other ranks.
    """
    main = is_main_rank()
    if main and recipe_state is None:
        raise ValueError("recipe_state: required on rank 0")
    root = Path(root)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()  # nobody writes into tmp before rank 0 has cleared it
    model_sd, optim_sd = _trainable_state_dicts(model, optimizer)
    ctx = _quiet()
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    finally:
        ctx.__exit__(None, None, None)
    if not main:
        return final  # dcp.save returns on every rank once the metadata is written
    (tmp / RECIPE_STATE).write_text(json.dumps(recipe_state))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint folder, or None."""
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / RECIPE_STATE).exists() else None


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load model and optimizer state in place from ``path``; return the recipe state.

    Works whatever world size wrote the checkpoint (DCP reshards to this model's layout).
    """
    path = Path(path)
    model_sd, optim_sd = _trainable_state_dicts(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    ctx = _quiet()
    try:
        dcp.load(state, checkpoint_id=str(path))
    finally:
        ctx.__exit__(None, None, None)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_LOAD_TRAINABLE
    )
    return json.loads((path / RECIPE_STATE).read_text())


def rng_state() -> dict:
    """Python and torch RNG state as JSON-able data."""
    import random

    return {"python": repr(random.getstate()), "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict) -> None:
    import ast
    import random

    random.setstate(ast.literal_eval(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
