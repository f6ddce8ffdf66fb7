"""Every package folder under ``training/`` has a README.md that names each of its modules.

A folder counts when it holds an ``__init__.py`` or any ``.py`` / ``.c`` file; its README must
exist and mention every such file by name (``__init__.py`` excepted), so a module added, renamed or
split without its row in the folder's file table fails here."""

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
SOURCE_SUFFIXES = (".py", ".c")


def package_folders() -> list[Path]:
    """Folders under ``training/`` (itself included) holding an ``__init__.py`` or a source file."""
    found = {p.parent for suffix in SOURCE_SUFFIXES for p in (ROOT / "training").rglob(f"*{suffix}")}
    return sorted(d for d in found if "__pycache__" not in d.parts)


def modules_of(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in SOURCE_SUFFIXES and p.name != "__init__.py")


def test_package_folders_are_found():
    names = {d.relative_to(ROOT).as_posix() for d in package_folders()}
    assert {"training", "training/utils", "training/utils/rl/rollout", "training/deployment/engine"} <= names
    assert "native_decode.c" in modules_of(ROOT / "training" / "deployment" / "engine" / "runners")


@pytest.mark.parametrize("folder", package_folders(), ids=lambda d: d.relative_to(ROOT).as_posix())
def test_folder_readme_names_every_module(folder: Path):
    readme = folder / "README.md"
    assert readme.is_file(), f"{folder.relative_to(ROOT)}: no README.md (a file -> purpose table of its modules)"
    text = readme.read_text()
    missing = [name for name in modules_of(folder) if not re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text)]
    assert not missing, f"{readme.relative_to(ROOT)} does not mention {missing}"
