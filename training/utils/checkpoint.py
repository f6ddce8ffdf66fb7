"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizer, recipe state.

Layout under ``<log_path>/checkpoints``::

    step_000010/   .metadata, *.distcp (DCP), recipe_state.json, manifest.json (written last)
    latest         the name of the newest complete checkpoint folder

A checkpoint is written into ``step_XXXXXX.tmp``, verified against its manifest and renamed once
complete, and ``latest`` is replaced atomically after that, so a crash mid-write leaves the
previous checkpoint usable; old ones are pruned only then (the newest ``keep_last`` that verify
stay). A disk that fills during the write removes the partial folder and raises
``CheckpointNoSpace`` (ENOSPC, the bytes needed and free); the previous checkpoint and ``latest``
are untouched.

Resume takes the newest checkpoint that verifies (``checkpoint_files.verify_checkpoint``: sizes,
checksums, a parsable ``recipe_state.json``) and loads; a bad or missing newer one, or a garbage
``latest``, is skipped with one warning naming it and the folder used instead, and ``latest`` is
rewritten. When folders exist but none loads, ``NoUsableCheckpoint`` names each and why: a run
never starts over from step 0 silently.

Under ``torchrun`` saving and loading are collectives (every rank calls them with the same path):
``get_state_dict`` gives each rank its FSDP2 shards and DCP writes one ``.distcp`` file per
rank; rank 0 alone writes ``recipe_state.json`` and ``manifest.json``, renames folders, rewrites
``latest`` and prunes old ones. DCP
reshards on load, so a checkpoint written by N ranks loads into M ranks, or into a plain
single-process model (and the other way round).

Only trainable parameters are stored (``ignore_frozen_params``): every weight in full
fine-tuning, the adapters with LoRA (the frozen base weights come from ``base_model`` again on
resume), with the optimizer state of each. With a critic (``advantage="gae"``: ``critic=``, a
``training.trainer.value_head.ValueHead``) its head and AdamW state are stored under ``critic`` beside them; a
checkpoint without them does not load into a run with a critic (and a run without one ignores them).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from training.utils.checkpoint_files import (
    LATEST,
    RECIPE_STATE,
    checkpoint_folders,
    pointer_problem,
    scan_checkpoints,
    unusable_message,
    verify_checkpoint,
    write_manifest,
)
from training.utils.dist import barrier, is_main_rank
from training.utils.run_record import NoUsableCheckpoint

log = logging.getLogger(__name__)
_TRAINABLE = StateDictOptions(ignore_frozen_params=True)
"""What a checkpoint holds of the model: the parameters that train (frozen ones are reloaded from the base model)."""
_LOAD_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading them: the frozen parameters are absent on purpose (``dcp.load`` itself fails on a trainable one missing)."""


def _quiet():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    return ctx


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, critic=None, reference=None) -> dict:
    """What DCP writes and reads: ``model`` and ``optim`` (trainable only), ``critic`` (head, optimizer) if given, and
    ``reference`` (a refreshed reference model's weights, ``LossConfig.reference_refresh_interval``) if given."""
    model_sd, optim_sd = _trainable_state_dicts(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if critic is not None:
        head_sd, head_optim_sd = get_state_dict(critic.head, critic.optimizer)
        state["critic"] = {"model": head_sd, "optim": head_optim_sd}
    if reference is not None:
        state["reference"] = get_model_state_dict(reference.model)
    return state


def _set_critic(critic, state: dict) -> None:
    set_state_dict(
        critic.head,
        critic.optimizer,
        model_state_dict=state["critic"]["model"],
        optim_state_dict=state["critic"]["optim"],
    )


def _trainable_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``get_state_dict`` without frozen parameters, also under their tied aliases (a tied ``lm_head``)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


class CheckpointNoSpace(OSError):
    """The disk filled while a checkpoint was written (ENOSPC): one line naming the folder, the bytes it needs and
    the bytes free. The partial folder is removed; the previous checkpoint and ``latest`` are untouched."""

    def __str__(self) -> str:
        return self.strerror


def _no_space(error: BaseException) -> bool:
    """Whether ``error`` is (or wraps: DCP gathers each rank's failure into a ``CheckpointException``) an ENOSPC."""
    seen = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if isinstance(e, CheckpointException):
            todo += [exc for exc, _ in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    return False


def _tensor_bytes(tree) -> int:
    """The bytes of every tensor in a (nested) state dict: this rank's shards of a sharded one."""
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return local.numel() * local.element_size()
    return 0


def _folder_bytes(folder: Optional[Path]) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) if folder is not None else 0


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    recipe_state: Optional[dict],
    keep_last: int = 2,
    critic=None,
    reference=None,
) -> Path:
    """Write checkpoint ``step`` (its manifest last), verify it, point ``latest`` at it; then keep the newest
    ``keep_last`` checkpoints that verify (older folders are deleted; the new one always counts).

    ``recipe_state`` is required on rank 0 and ignored on the other ranks. Raises ``CheckpointNoSpace`` when the
    disk fills (the partial folder removed, the previous checkpoint and ``latest`` unchanged).
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
    state = _state(model, optimizer, critic, reference)
    ctx = _quiet()
    try:
        dcp.save(state, checkpoint_id=str(tmp))
        if main:
            (tmp / RECIPE_STATE).write_text(json.dumps(recipe_state))
            write_manifest(tmp)
    except (OSError, CheckpointException) as e:
        if not _no_space(e):
            raise
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = next((f for f in checkpoint_folders(root) if f != final), None)
        needed = max(_tensor_bytes(state), _folder_bytes(previous))
        free = shutil.disk_usage(root).free
        raise CheckpointNoSpace(
            errno.ENOSPC,
            f"no space left on device (ENOSPC) writing checkpoint {tmp}: it needs about {needed:,} bytes, "
            f"{free:,} are free on that disk; the partial folder was removed and "
            f"{previous.name if previous else 'no earlier checkpoint'} is unchanged; free space or use another "
            "log_path",
        ) from None
    finally:
        ctx.__exit__(None, None, None)
    if not main:
        return final  # dcp.save returns on every rank once the metadata is written
    reason = verify_checkpoint(tmp)
    if reason is not None:
        raise RuntimeError(f"checkpoint {tmp} fails its own check right after the write: {reason}")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _point_latest(root, final)
    _prune(root, keep_last)
    return final


def _point_latest(root: Path, folder: Path) -> None:
    """Replace ``root/latest`` atomically with ``folder``'s name (rank 0)."""
    latest_tmp = root / f"{LATEST}.tmp"
    latest_tmp.write_text(folder.name)
    os.replace(latest_tmp, root / LATEST)


def _prune(root: Path, keep_last: int) -> None:
    """Delete every checkpoint folder older than the newest ``keep_last`` that verify (a bad one never counts)."""
    kept = 0
    for folder in checkpoint_folders(root):
        if kept >= keep_last:
            shutil.rmtree(folder, ignore_errors=True)
        elif verify_checkpoint(folder) is None:
            kept += 1


def _settle(root: Path, chosen: Path, skipped: list[tuple[Path, str]]) -> None:
    """After choosing ``chosen``: one warning when newer folders or ``latest`` were unusable; ``latest`` rewritten."""
    problems = [f"skipped {folder.name} ({why})" for folder, why in skipped]
    pointer = pointer_problem(root)
    if pointer is not None:
        problems.append(pointer)
    if problems:
        log.warning("checkpoints in %s: %s; resuming from %s instead", root, "; ".join(problems), chosen.name)
    try:
        current = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        current = None
    if current != chosen.name and is_main_rank():
        _point_latest(root, chosen)


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The newest checkpoint folder under ``root`` that verifies (``verify_checkpoint``), or None.

    ``latest`` is a hint: when it is missing, garbage or names a missing or bad folder, the ``step_*`` folders are
    scanned newest first; each bad one is skipped, the skips named in one warning with the folder chosen, and
    ``latest`` is rewritten to it."""
    root = Path(root)
    skipped = []
    for folder, reason in scan_checkpoints(root):
        if reason is None:
            _settle(root, folder, skipped)
            return folder
        skipped.append((folder, reason))
    return None


def _one_line(error: BaseException) -> str:
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def load_latest_checkpoint(
    root: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, critic=None, reference=None
) -> Optional[tuple[Path, dict]]:
    """Resume: load the newest checkpoint under ``root`` that verifies and loads; return it and its recipe state.

    A folder that fails ``verify_checkpoint`` or the DCP load is skipped for the next older one (one warning names
    the skipped folders and the one used; ``latest`` is rewritten). None when ``root`` holds no checkpoint folder;
    ``NoUsableCheckpoint`` (one line: each folder and why, and the fix) when it holds some but none loads."""
    root = Path(root)
    skipped = []
    for folder, reason in scan_checkpoints(root):
        if reason is None:
            try:
                state = load_checkpoint(folder, model, optimizer, critic, reference)
            except (Exception, CheckpointException) as e:
                reason = f"does not load: {_one_line(e)}"
            else:
                _settle(root, folder, skipped)
                return folder, state
        skipped.append((folder, reason))
    if skipped:
        raise NoUsableCheckpoint(unusable_message(root, skipped))
    return None


def load_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, critic=None, reference=None
) -> dict:
    """Load model and optimizer state (and ``critic``'s and ``reference``'s, when given) in place from ``path``; return
    the recipe state.

    Works whatever world size wrote the checkpoint (DCP reshards to this model's layout).
    """
    path = Path(path)
    state = _state(model, optimizer, critic, reference)
    ctx = _quiet()
    try:
        dcp.load(state, checkpoint_id=str(path))
    finally:
        ctx.__exit__(None, None, None)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_LOAD_TRAINABLE
    )
    if critic is not None:
        _set_critic(critic, state)
    if reference is not None:
        set_model_state_dict(reference.model, state["reference"])
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
