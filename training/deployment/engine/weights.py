"""Reading safetensors checkpoints and validating a weight update before anything is swapped.

Names are the checkpoint's own (``model.layers.0.self_attn.q_proj.weight``...). Only
safetensors is read (never pickle). A tied ``lm_head.weight`` is not stored in the files; an
update may still carry it (a trainer's ``state_dict()`` does) if it equals the embedding.
"""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path
from typing import Iterator, Mapping

import torch
from safetensors import safe_open

from training.deployment.engine.requests import WeightUpdateError
from training.utils.safetensors_index import SafetensorsFileError, read_index

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


class WeightFileError(SafetensorsFileError):
    """A file that is not a readable safetensors file, or that changed while it was read. The message names
    the file and what is wrong with it, never its bytes or its size (a refusal must not be a way to read
    any file the server can read, a few bytes at a time)."""


def _file_stamp(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


class MappedWeights(Mapping[str, torch.Tensor]):
    """The tensors of safetensors files as read-only CPU views on the files' pages (``mmap``): nothing is copied.

    Reading a tensor first hands the pages read so far back to the kernel once the tensors handed out since
    the last time reach ``RELEASE_BYTES`` (``madvise(MADV_DONTNEED)`` over every file: a view read again
    faults its pages back in from the file, with the same values), so a consumer that reads the tensors one
    after another holds at most ``RELEASE_BYTES`` and one tensor of the files in its resident memory, not
    the whole files: a server taking a weight push reads a model's worth of file pages and keeps a few
    tensors of it (safetensors' ``load_file`` keeps every page it touched mapped until the last tensor is
    dropped). A consumer that reads each tensor twice (the server's NaN check, then the load) reads its
    pages from the page cache twice: ~60 ms of a SmolLM2 push. The views must not be written to (the
    mapping is read-only).

    Each file's size and mtime are recorded as it is mapped; ``changed()`` names the files whose mapped inode
    differs now (written or truncated in place), so a reader checks it after reading and refuses what it
    read. A file replaced by a rename is not changed: the mapping holds the old inode, which stays whole.
    Malformed files raise ``WeightFileError``.
    """

    RELEASE_BYTES = 32 * 2**20
    """Bytes handed out between two releases."""

    def __init__(self, files: list[Path]):
        self._maps: list[mmap.mmap] = []
        self._unreleased = 0
        """Bytes of the tensors handed out since the last ``release_pages``."""
        self._where: dict[str, tuple[int, torch.dtype, tuple[int, ...], int, int]] = {}
        """name → (file index, dtype, shape, start, end): the byte range in that file."""
        self._stamps: list[tuple[Path, tuple[int, int, int]]] = []
        """(file, (inode, size, mtime_ns)) as each file was mapped."""
        self._fds: list[int] = []
        """A descriptor of each mapped file (its inode, whatever its path names now)."""
        for f in files:
            with open(f, "rb") as fh:
                stamp = _file_stamp(os.fstat(fh.fileno()))
                try:
                    spans = read_index(fh, f, stamp[1])
                except SafetensorsFileError as e:
                    raise WeightFileError(str(e)) from None
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                self._fds.append(os.dup(fh.fileno()))  # to stamp the mapped inode itself later
            for name, span in spans.items():
                self._where[name] = (len(self._maps), span.dtype, span.shape, span.start, span.end)
            self._maps.append(mapped)
            self._stamps.append((Path(f), stamp))

    def __getitem__(self, name: str) -> torch.Tensor:
        i, dtype, shape, start, end = self._where[name]
        if self._unreleased >= self.RELEASE_BYTES:
            self.release_pages()
        self._unreleased += end - start
        count = (end - start) // dtype.itemsize
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # read-only by contract: torch warns that it cannot enforce that
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._maps[i], dtype=dtype, count=count, offset=start)
        return flat.view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def changed(self) -> list[Path]:
        """The mapped files whose size or mtime differ from when they were mapped (written or truncated in
        place); a file renamed over or deleted since is not changed (the mapping holds the old inode)."""
        return [f for (f, stamp), fd in zip(self._stamps, self._fds) if _file_stamp(os.fstat(fd)) != stamp]

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", ()):
            os.close(fd)

    def release_pages(self) -> None:
        """Give the pages of the files read so far back to the kernel (the views stay valid)."""
        self._unreleased = 0
        for m in self._maps:
            if hasattr(m, "madvise"):  # Python builds without it (not Linux) keep the pages until the views go
                m.madvise(mmap.MADV_DONTNEED)


def load_safetensors(path: str | Path) -> MappedWeights:
    """All tensors of a safetensors folder (or file), as read-only CPU views on the files (``MappedWeights``)."""
    return MappedWeights(safetensors_files(path))


def validate_update(
    tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], tied: bool
) -> Mapping[str, torch.Tensor]:
    """Check that ``tensors`` is a full, shape-matching set; return it as it is (nothing copied: the runners
    read it by their own names, so a redundant tied head in it is never read).

    Raises :class:`WeightUpdateError` naming the first missing, extra or mismatched tensor.
    """
    names = set(tensors)
    if tied and TIED_HEAD in names and TIED_HEAD not in expected:
        names.discard(TIED_HEAD)
        head, emb = tensors[TIED_HEAD], tensors.get(EMBED)
        if emb is None or head.shape != emb.shape or not torch.equal(head.cpu(), emb.cpu()):
            raise WeightUpdateError(
                f"{TIED_HEAD}: the model ties it to {EMBED}, but the update gives a different tensor"
            )
    missing = sorted(set(expected) - names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightUpdateError(f"{missing[0]}: missing from the update{more}; a full set is required")
    extra = sorted(names - set(expected))
    if extra:
        raise WeightUpdateError(f"{extra[0]}: not a weight of this model")
    for name, shape in expected.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise WeightUpdateError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(shape):
            raise WeightUpdateError(f"{name}: shape {tuple(t.shape)} does not match the model's {tuple(shape)}")
        if not (t.is_floating_point()):
            raise WeightUpdateError(f"{name}: dtype {t.dtype} is not a floating-point type")
    return tensors
