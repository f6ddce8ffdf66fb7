"""Whether a checkpoint folder can be resumed from, checked without torch (``checkpoint.py`` and ``run_record.py``
both ask here, so the run-folder policy and the resume agree on which checkpoints count).

A checkpoint folder ``<root>/step_XXXXXX`` holds DCP's ``.metadata`` and ``*.distcp`` files, ``recipe_state.json``
and, written last, ``manifest.json`` (``MANIFEST``): every other file's name and size; a sha256 of each small file
(``recipe_state.json``, ``.metadata``) and of a sample of each ``.distcp`` file (its first and last
``SAMPLE_BYTES``), so a truncated, zeroed or missing file is caught without reading gigabytes. A fault inside a
big file outside the sample still fails the DCP load itself; ``load_latest_checkpoint`` then falls back too.

``<root>/latest`` names the newest checkpoint folder; it is a hint: the newest folder that verifies wins, whatever
``latest`` says (``checkpoint.latest_checkpoint`` rewrites it to match).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterator, Optional

MANIFEST = "manifest.json"
RECIPE_STATE = "recipe_state.json"
METADATA = ".metadata"
LATEST = "latest"
SAMPLE_BYTES = 64 * 1024
"""How much of the head and of the tail of each ``.distcp`` file the manifest's sample checksum covers."""
_FOLDER = re.compile(r"step_\d+")


def _sha256(path: Path, sample: bool) -> str:
    """sha256 of the whole file, or (``sample``) of its first and last ``SAMPLE_BYTES`` (the whole of a small one)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not sample or size <= 2 * SAMPLE_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        else:
            digest.update(f.read(SAMPLE_BYTES))
            f.seek(size - SAMPLE_BYTES)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _entry(path: Path) -> dict:
    sample = path.suffix == ".distcp"
    return {"size": path.stat().st_size, ("sha256_sample" if sample else "sha256"): _sha256(path, sample)}


def write_manifest(folder: str | os.PathLike) -> Path:
    """Write ``folder/manifest.json`` over every other file in ``folder``: the last file a checkpoint gets."""
    folder = Path(folder)
    files = {p.name: _entry(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    path = folder / MANIFEST
    path.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    return path


def verify_checkpoint(folder: str | os.PathLike) -> Optional[str]:
    """None when ``folder`` is a checkpoint to resume from, else why not (a few words, naming the file).

    With a manifest: every file it lists is there with its size and checksum, and ``recipe_state.json`` parses.
    A checkpoint written before manifests existed (no ``manifest.json``) is accepted when it has a non-empty
    ``.metadata`` and a ``recipe_state.json`` that parses, so old runs still resume; a damaged ``.distcp`` in one is
    caught by the DCP load (``checkpoint.load_latest_checkpoint`` falls back to an older checkpoint then)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "no such folder"
    manifest = folder / MANIFEST
    if manifest.exists():
        try:
            files = json.loads(manifest.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{MANIFEST} does not parse ({type(e).__name__})"
        for name in (METADATA, RECIPE_STATE):
            if name not in files:
                return f"{MANIFEST} lists no {name}"
        for name, want in files.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            size = path.stat().st_size
            if size != want.get("size"):
                return f"{name} has {size} bytes, the manifest says {want.get('size')}"
            kind = "sha256_sample" if "sha256_sample" in want else "sha256"
            if _sha256(path, kind == "sha256_sample") != want.get(kind):
                return f"{name} does not match its checksum"
    else:
        metadata = folder / METADATA
        if not metadata.is_file():
            return f"no {MANIFEST} and no {METADATA}"
        if metadata.stat().st_size == 0:
            return f"no {MANIFEST} and {METADATA} is empty"
    try:
        json.loads((folder / RECIPE_STATE).read_text())
    except FileNotFoundError:
        return f"{RECIPE_STATE} is missing"
    except (OSError, ValueError) as e:
        return f"{RECIPE_STATE} does not parse ({type(e).__name__})"
    return None


def checkpoint_folders(root: str | os.PathLike) -> list[Path]:
    """Every finished checkpoint folder under ``root`` (``step_<digits>``; never a ``.tmp``), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _FOLDER.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=folder_step, reverse=True)


def folder_step(folder: Path) -> int:
    """The step a checkpoint folder holds (``step_000010`` -> 10)."""
    return int(folder.name[len("step_") :])


def checkpoint_steps(root: str | os.PathLike) -> list[int]:
    """The steps of the checkpoint folders under ``root``, ascending (usable or not)."""
    return sorted(folder_step(p) for p in checkpoint_folders(root))


def scan_checkpoints(root: str | os.PathLike) -> Iterator[tuple[Path, Optional[str]]]:
    """``(folder, verify_checkpoint(folder))`` for each checkpoint folder under ``root``, newest first (lazily)."""
    for folder in checkpoint_folders(root):
        yield folder, verify_checkpoint(folder)


def pointer_problem(root: str | os.PathLike) -> Optional[str]:
    """What is wrong with ``root/latest`` when ``root`` holds checkpoint folders (None when nothing is)."""
    root = Path(root)
    pointer = root / LATEST
    if not checkpoint_folders(root):
        return None
    if not pointer.is_file():
        return f"{LATEST} is missing"
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return f"{LATEST} does not read as text"
    if not _FOLDER.fullmatch(name):
        return f"{LATEST} holds {name[:40]!r}, not a checkpoint folder name"
    if not (root / name).is_dir():
        return f"{LATEST} names {name}, which does not exist"
    return None


def has_usable_checkpoint(root: str | os.PathLike) -> bool:
    """Whether any checkpoint folder under ``root`` verifies."""
    return any(reason is None for _, reason in scan_checkpoints(root))


def unusable_message(root: str | os.PathLike, problems: list[tuple[Path, str]]) -> str:
    """The one-line error for a ``root`` whose checkpoint folders all fail: each folder and why, and the fix."""
    listed = "; ".join(f"{folder.name}: {why}" for folder, why in problems)
    return (
        f"error: {root} holds checkpoints but none can be resumed from ({listed}); delete {root} to start the run "
        "over, or use another log_path"
    )
