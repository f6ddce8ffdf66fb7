"""Device and dtype names, resolved the same way by the trainer and the inference engine.

``auto`` means CUDA when it is available, else the CPU. A dtype of ``auto`` means bfloat16 on
CUDA and float32 elsewhere (bfloat16 is several times slower than float32 on CPUs without
native support, and float32 keeps logprobs exact against the trainer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Names a ``dtype`` setting accepts."""
DEVICES = ("auto", "cpu", "cuda")
"""Names a ``device`` setting accepts, besides ``cuda:N``."""


def is_device_name(name: str) -> bool:
    """True for ``auto``, ``cpu``, ``cuda`` and ``cuda:N``."""
    return name in DEVICES or (name.startswith("cuda:") and name[5:].isdigit())


def resolve_device(name: str) -> torch.device:
    """``auto`` → the current CUDA device if CUDA is available, else ``cpu``; ``cuda`` → the current CUDA device;
    ``cpu`` and ``cuda:N`` as given. A CUDA device always comes back with its index (``cuda:0``, never a bare
    ``cuda``): ``torch.cuda.set_device`` and CUDA-graph capture need one.

    Raises ``ValueError`` naming the setting when CUDA is asked for but missing.
    """
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if is_device_name(name):
        if not torch.cuda.is_available():
            raise ValueError(f"device: {name!r} requested but CUDA is not available")
        device = torch.device(name)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device: {name!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
        return device
    raise ValueError(f"device: {name!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")


def resolve_dtype(name: str, device: Union[str, torch.device]) -> torch.dtype:
    """``auto`` → bfloat16 on CUDA, float32 elsewhere; otherwise the named dtype."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {DTYPES}")
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, name)
