"""The index of a safetensors file, read from its header alone: each tensor's dtype, shape and byte range.

A safetensors file is an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": ...}``, then the tensors' bytes, each row-major. The engine maps
the byte ranges (``training/deployment/engine/weights.py``: ``MappedWeights``) and the trainer reads row ranges of
them (``training/trainer/sharded_load.py``); both read the index here. Errors name the file and what is wrong,
never its bytes or its size: a refusal must not be a way to read a file a few bytes at a time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""The safetensors dtype names read here."""


class SafetensorsFileError(ValueError):
    """A file that is not a readable safetensors file; the message names the file and the fault, never its bytes."""


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor lies in its file: ``[start, end)`` bytes from the file's start."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    def row_bytes(self) -> int:
        """Bytes of one index of dimension 0 (the whole tensor for a 0-d one)."""
        return (self.end - self.start) // self.shape[0] if self.shape and self.shape[0] else self.end - self.start


def read_index(fh: BinaryIO, path: Path, size: int) -> dict[str, TensorSpan]:
    """Every tensor of the open file ``fh`` (``size`` bytes, named ``path`` in errors), validated: the header is a JSON
    object, each dtype is known, each range lies within the file and holds exactly its dtype and shape."""
    fh.seek(0)
    n = int.from_bytes(fh.read(8), "little")
    if size < 8 or n > size - 8:
        raise SafetensorsFileError(f"{path}: not a safetensors file (its first 8 bytes are no header length)")
    try:
        header = json.loads(fh.read(n))
    except ValueError:  # also UnicodeDecodeError; their messages quote the bytes
        header = None
    if not isinstance(header, dict):
        raise SafetensorsFileError(f"{path}: not a safetensors file (its header is not a JSON object)")
    spans = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, offsets = info["dtype"], tuple(info["shape"]), tuple(info["data_offsets"])
            start, end = (8 + n + int(o) for o in offsets)
        except (TypeError, KeyError, ValueError):
            raise SafetensorsFileError(f"{path}: tensor {name!r} has no valid dtype, shape and offsets") from None
        if dtype_name not in SAFETENSORS_DTYPES:
            raise SafetensorsFileError(
                f"{path}: tensor {name!r} has dtype {dtype_name}, not one of {list(SAFETENSORS_DTYPES)}"
            )
        dtype = SAFETENSORS_DTYPES[dtype_name]
        if end > size:
            raise SafetensorsFileError(f"{path}: tensor {name!r} ends at byte {end}, past the end of the file")
        if end - start != math.prod(shape) * dtype.itemsize:
            raise SafetensorsFileError(f"{path}: tensor {name!r} does not hold a {dtype_name} {shape}")
        spans[name] = TensorSpan(dtype, shape, start, end)
    return spans
