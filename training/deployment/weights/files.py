"""The file format and folder of weight pushes: safetensors (never pickle), written once per push.

- ``write_safetensors`` writes named tensors to one file atomically (temp file, then rename);
  tied tensors are copied apart (safetensors refuses shared storage); with ``dtype`` (the server's,
  ``GET /weight_version``) floating-point tensors are cast one at a time as they are staged, so a
  bf16 server gets a bf16 file (half the bytes of the fp32 master weights).
- ``WeightFolder.placement`` checks the free space first (``shm_free_bytes``: /dev/shm is 64 MB by
  default in Docker) against what the write needs: the new file is written beside the old one and
  renamed over it, so it needs its own size free (``"beside"``); when only one copy fits, the old
  file is removed before the new one is written (``"in_place"``: a server restarted in that window
  finds no file until the write ends; the servers already loaded keep their weights, which they
  hold in their own memory); when not even that fits, ``DeploymentGroup`` writes to disk instead.
- ``WeightFolder`` is where a push writes: a private folder under /dev/shm (``shm``, same host:
  the server memory-maps the file) or a folder on disk (``disk``, any host that sees it).

A /dev/shm copy is a full model in RAM, so none is left behind: a failed write removes its temp
file; an owned shm folder is removed by ``remove()`` (``DeploymentGroup.stop``), at interpreter
exit (normal exit, an exception, Ctrl-C, and SIGTERM under the recipe, which turns it into
``SystemExit``); and the folder of a process that died by SIGKILL, whose name carries its pid, is
swept by the next ``WeightFolder(mode="shm")`` on the host (the owner-pid sweep at start,
``sweep_stale_shm``: a folder whose owner pid is dead is removed; a live owner's is kept).

Who loads the file into which server is ``DeploymentGroup.push`` (``group.py``): it writes once
and loads the file into every replica through that engine's own endpoint.
"""

from __future__ import annotations

import asyncio
import atexit
import math
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterable, Optional

import torch

from training.utils.openmp import releasing_openmp_threads

SHM_DIR = Path("/dev/shm")


class WeightSyncError(RuntimeError):
    """A server refused or failed a weight update."""


def shm_dir() -> Path:
    """Where shm-mode files go: /dev/shm, else the temp dir (the server accepts the same roots)."""
    return SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())


def shm_free_bytes(folder: Path) -> int:
    """Free bytes of the filesystem holding ``folder`` (/dev/shm: 64 MB by default in Docker). A named
    probe, so that tests can stand in a tiny budget for a full /dev/shm (which cannot be made safely)."""
    return shutil.disk_usage(folder).free


def weights_nbytes(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], dtype: Optional[torch.dtype]) -> int:
    """Bytes of the tensors of ``specs`` (``(name, dtype, shape)``) once cast to ``dtype`` (None: as they are)."""
    total = 0
    for _, d, shape in specs:
        total += math.prod(shape) * ((dtype or d) if d.is_floating_point else d).itemsize
    return total


def write_safetensors(
    named_weights: Iterable[tuple[str, torch.Tensor]], path: str | os.PathLike, dtype: Optional[torch.dtype] = None
) -> int:
    """Write tensors to ``path`` (CPU, contiguous; tied tensors copied apart; floating-point ones cast
    to ``dtype`` one at a time, the server's dtype, so the file holds what it loads). Returns bytes written."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, t in named_weights:
        if name in tensors:
            raise ValueError(f"named_weights: duplicate tensor name {name!r}")
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        t = t.detach().to(device="cpu", dtype=cast).contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage:  # safetensors refuses shared storage (tied embeddings)
            t = t.clone()
        seen_storage.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    if not tensors:
        raise ValueError("named_weights: no tensors given")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a failed or interrupted write leaves no partial copy
    return path.stat().st_size


SHM_PREFIX = "training-weights-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_stale_shm() -> list[Path]:
    """Remove shm weight folders (and files of older versions) whose owning process is gone; returns them."""
    removed = []
    for path in shm_dir().glob(f"{SHM_PREFIX}*"):
        try:
            pid = int(path.name[len(SHM_PREFIX) :].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


class WeightFolder:
    """The folder pushed weights are written to: ``<folder>/model.safetensors``, replaced atomically
    at every push, so a restarted server always finds the newest complete file.

    ``mode="shm"``: a private folder under /dev/shm (same host only), owned by this object and
    removed by ``remove()``. ``mode="disk"``: ``directory`` (which servers on other hosts may read);
    the file is kept there.
    """

    def __init__(self, mode: str, directory: Optional[str] = None):
        if mode not in ("shm", "disk"):
            raise ValueError(f"mode: {mode!r} is not one of ('shm', 'disk')")
        if mode == "disk" and not directory:
            raise ValueError("directory: required with mode='disk'")
        self.mode = mode
        if mode == "shm":
            sweep_stale_shm()
            self.folder = shm_dir() / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            atexit.register(self.remove)
        else:
            self.folder = Path(directory).resolve()
        self.folder.mkdir(parents=True, exist_ok=True)

    @property
    def file(self) -> Path:
        return self.folder / "model.safetensors"

    def write(
        self,
        named_weights: Iterable[tuple[str, torch.Tensor]],
        dtype: Optional[torch.dtype] = None,
        in_place: bool = False,
    ) -> dict:
        """Write the tensors (see ``write_safetensors``); returns ``{"bytes", "write_s"}``. ``in_place``
        removes the current file first (``placement`` said only one copy fits)."""
        t0 = time.perf_counter()
        if in_place:
            self.file.unlink(missing_ok=True)
        written = write_safetensors(named_weights, self.file, dtype)
        return {"bytes": written, "write_s": time.perf_counter() - t0}

    async def write_async(
        self,
        named_weights: Iterable[tuple[str, torch.Tensor]],
        dtype: Optional[torch.dtype] = None,
        in_place: bool = False,
    ) -> dict:
        return await asyncio.to_thread(releasing_openmp_threads(self.write), named_weights, dtype, in_place)

    def placement(self, nbytes: int) -> Optional[str]:
        """How a file of ``nbytes`` fits: ``"beside"`` (free space holds it next to the current file, which
        the rename then replaces), ``"in_place"`` (only once the current file is removed), or None."""
        free = shm_free_bytes(self.folder)
        if nbytes <= free:
            return "beside"
        current = self.file.stat().st_size if self.file.exists() else 0
        if current and nbytes <= free + current:
            return "in_place"
        return None

    def fits(self, nbytes: int) -> bool:
        """Whether a file of ``nbytes`` can be written here at all (``placement`` is not None)."""
        return self.placement(nbytes) is not None

    def remove(self) -> None:
        """Delete an owned /dev/shm folder (a full model copy in RAM); a disk folder stays."""
        if self.mode == "shm":
            shutil.rmtree(self.folder, ignore_errors=True)
            atexit.unregister(self.remove)
