"""Loading a model under FSDP2 without a whole copy on any rank (torchtitan's way).

    model = load_sharded(model_path, device, dtype, gradient_checkpointing=True)   # every rank calls it

1. The model is built on the ``meta`` device from its config: no parameter memory anywhere.
2. ``fully_shard`` per decoder layer and the root (``distributed.shard_model``, with its
   mixed-precision policy); then ``to_empty`` allocates each rank's shards only.
3. Each rank reads, for every parameter, only the rows of its own shard from the safetensors files
   (``SafetensorsRows``: one ``read`` of the row range's bytes, no memory map, so the file's pages never
   count in the rank's resident memory), cast to ``dtype``. Persistent buffers are read whole (they are small); non-persistent ones
   (RoPE's ``inv_freq``) are computed again by building their module on the CPU from the config.

A rank's peak memory while loading is therefore its shards plus one slice; no rank and no host holds
the whole model (trainer README, "Loading under FSDP2", has the measurement). Where the files cannot
be sliced by parameter name (a GGUF file, checkpoint keys that ``transformers`` renames on load, a
module whose buffers cannot be rebuilt), rank 0 loads the model on the CPU and broadcasts each shard
(``set_model_state_dict(..., broadcast_from_rank0=True)``): one host copy on rank 0, none on the others;
the log line says which path ran and why.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from training.trainer.distributed import shard_model
from training.trainer.model import PACKED_SDPA, prepare_for_training, register_packed_sdpa
from training.utils.dist import rank, world_size
from training.utils.safetensors_index import read_index

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"


def checkpoint_files(model_path: str, load_kwargs: dict) -> Optional[dict[str, Path]]:
    """Parameter name → the safetensors file holding it, for a local folder; None where the weights cannot be
    read by name (a hub id not in a folder, a GGUF file, no safetensors)."""
    folder = Path(model_path)
    if load_kwargs.get("gguf_file") or not folder.is_dir():
        return None
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SAFETENSORS_FILE
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def shard_rows(total_rows: int, local_rows: int) -> tuple[int, int]:
    """The ``[start, stop)`` rows of dimension 0 this rank's FSDP2 shard holds: ``torch.chunk`` over the ranks
    (chunks of ``ceil(total / world)`` rows, the last ones shorter or empty)."""
    chunk = -(-total_rows // world_size())
    start = min(rank() * chunk, total_rows)
    return start, start + local_rows


def build_on_meta(model_path: str, dtype: torch.dtype, load_kwargs: dict) -> torch.nn.Module:
    """The model of ``model_path``'s config, every parameter and buffer on ``meta`` (nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    register_packed_sdpa()
    config_kwargs = {k: v for k, v in load_kwargs.items() if k in ("revision", "trust_remote_code")}
    config = AutoConfig.from_pretrained(model_path, **config_kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=load_kwargs.get("attn_implementation", PACKED_SDPA)
        )
    model.tie_weights()  # transformers 5.0 leaves a tied head untied in from_config
    return model


def rebuilt_buffers(model: torch.nn.Module) -> Optional[dict[str, torch.Tensor]]:
    """Non-persistent buffers (absent from checkpoints) computed on the CPU: each owning module built again from
    the model's config (``type(module)(config=...)``, the shape of ``transformers``' rotary embeddings). None when
    a module cannot be built that way."""
    out = {}
    for prefix, module in model.named_modules():
        names = module._non_persistent_buffers_set
        if not names:
            continue
        try:
            with torch.device("cpu"):
                fresh = type(module)(config=model.config)
        except Exception as exc:  # not the config-only constructor: the caller falls back to a full load
            logger.info("sharded load: cannot rebuild %s's buffers (%s)", prefix or type(module).__name__, exc)
            return None
        for name in names:
            out[f"{prefix}.{name}" if prefix else name] = getattr(fresh, name)
    return out


def load_sharded(
    model_path: str,
    device: Union[str, torch.device],
    dtype: torch.dtype,
    gradient_checkpointing: bool = False,
    compute_dtype: Optional[torch.dtype] = None,
    **load_kwargs: Any,
) -> torch.nn.Module:
    """The model of ``model_path`` sharded over the ranks with FSDP2 (``shard_model``), each rank having read only its
    own shards; every rank must call it. ``compute_dtype``: the mixed-precision policy's parameter dtype (see
    ``shard_model``). Falls back to rank 0 reading the whole model (module docstring) where slicing cannot work."""
    device = torch.device(device)
    model = build_on_meta(model_path, dtype, load_kwargs)
    files = checkpoint_files(model_path, load_kwargs)
    buffers = rebuilt_buffers(model)
    names = {name for name, _ in model.named_parameters()}
    names |= {name for name, _ in model.named_buffers() if buffers is None or name not in buffers}
    missing = sorted(names - set(files or {}))
    prepare_for_training(model, gradient_checkpointing)
    shard_model(model, device, compute_dtype=compute_dtype)
    model.to_empty(device=device)
    if files is None or buffers is None or missing:
        why = "no safetensors by name" if files is None else "buffers" if buffers is None else f"keys {missing[:3]}"
        logger.info("sharded load: rank 0 reads the whole model and broadcasts the shards (%s)", why)
        _broadcast_from_rank0(model, model_path, dtype, load_kwargs)
    else:
        _read_own_shards(model, files, dtype)
        logger.info("sharded load: each rank read its own shards of %s", model_path)
    with torch.no_grad():
        for name, value in (buffers or {}).items():
            model.get_buffer(name).copy_(value)
    return model


class SafetensorsRows:
    """Rows of the tensors of one safetensors file, read with ``pread`` (no memory map, so the pages read do not
    stay in this process's resident memory): a row range of a row-major tensor is one contiguous byte range."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            self.spans = read_index(f, path, os.fstat(f.fileno()).st_size)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.spans[name].shape

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of dimension 0 (a 0-d tensor: itself), as a new tensor in the file's dtype."""
        span = self.spans[name]
        shape = list(span.shape)
        offset, size = span.start, span.end - span.start
        if shape:
            offset, size, shape[0] = (
                span.start + start * span.row_bytes(),
                (stop - start) * span.row_bytes(),
                stop - start,
            )
        data = bytearray(size)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(offset)
            got = f.readinto(data)
        if got != size:
            raise OSError(f"{self.path}: {name} is truncated ({got} of {size} bytes)")
        return torch.frombuffer(data, dtype=span.dtype).reshape(shape) if size else torch.empty(shape, dtype=span.dtype)


def _read_own_shards(model: torch.nn.Module, files: dict[str, Path], dtype: torch.dtype) -> None:
    """Copy into every parameter's local shard the rows of it that this rank holds, and every buffer whole."""
    from torch.distributed.tensor import DTensor

    targets = dict(model.named_parameters())
    targets.update({n: b for n, b in model.named_buffers() if n in files})
    readers = {file: SafetensorsRows(file) for file in set(files[n] for n in targets)}
    with torch.no_grad():
        for name, target in targets.items():
            reader = readers[files[name]]
            local = target.to_local() if isinstance(target, DTensor) else target
            total = reader.shape(name)[0] if reader.shape(name) else 0
            if isinstance(target, DTensor) and local.ndim > 0:
                start, stop = shard_rows(target.shape[0], local.shape[0])
            else:
                start, stop = 0, total
            if local.ndim == 0 or stop > start:
                rows = reader.rows(name, start, stop)
                local.copy_(rows.to(dtype if local.is_floating_point() else local.dtype))


def _broadcast_from_rank0(model: torch.nn.Module, model_path: str, dtype: torch.dtype, load_kwargs: dict) -> None:
    """Rank 0 loads the whole model on the CPU; every rank receives its shards of it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    full = {}
    if rank() == 0:
        kwargs = {k: v for k, v in load_kwargs.items() if k != "attn_implementation"}
        full = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kwargs).state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, full, options=options)
