"""``check_base_model``: is a model name usable, found out in seconds, before anything loads?

A run names its model as a short name (``tiny``, ``smollm2``), a local folder or a Hugging Face hub id.
A mistake would otherwise surface late and unclear: a typo such as ``smolm2`` waits for the hub and ends
in a long transformers traceback, a missing folder reads as "Repo id must use alphanumeric chars". The
check decides what the name is and fails with one ``ConfigError`` line that says what was tried:

| the name | is taken as | checked |
| --- | --- | --- |
| one of ``SHORT_NAMES`` | a built-in model | nothing (built on first use) |
| starts with ``.``, ``/`` or ``~``; more than one ``/``; or its first part is a local folder | a local folder | it exists, is a folder, holds ``config.json`` |
| an existing folder | a local folder | holds ``config.json`` |
| no ``/`` and close to a short name | a typo | "did you mean ...?" |
| anything else | a hub id | valid id; in the local hub cache; else, unless offline, on the hub (``HUB_TIMEOUT_S``) |

Offline means ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, or the hub does not answer within
``HUB_TIMEOUT_S``; the error then says so. Resolving a name to a folder is ``resolve_model``'s job, not
this module's.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Optional

from training.models import SHORT_NAMES
from training.utils.config import ConfigError

HUB_TIMEOUT_S = 5.0
"""How long the check waits for the hub to answer before it calls the machine offline."""
_TRUE = ("1", "true", "yes", "on")


def check_base_model(
    name: str, field: str = "base_model", cache_dir: Optional[str] = None, timeout_s: float = HUB_TIMEOUT_S
) -> str:
    """What ``name`` is, in words for the start-up log (``"local folder /abs/path"``, ...).

    Raises ``ConfigError`` (``"<field>: ..."``, one line) when the name is none of: a short name, an
    existing model folder, a hub id in the local cache (``cache_dir``: default the hub's), or a hub id the
    hub knows. Loads no model; the network is asked only about an uncached hub id, and not when offline.
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{field}: must be a short name {SHORT_NAMES}, a local folder or a hub id, got {name!r}")
    if name in SHORT_NAMES:
        return f"{name!r} (built-in short name)"
    if _looks_like_path(name) or os.path.isdir(name):
        return _check_folder(name, field)
    close = difflib.get_close_matches(name.lower(), SHORT_NAMES, n=1, cutoff=0.6)
    if close and "/" not in name:
        raise ConfigError(
            f"{field}: {name!r} is no built-in model; did you mean {close[0]!r}? "
            f"(short names: {', '.join(SHORT_NAMES)}; else a local folder or a hub id such as org/name)"
        )
    return _check_hub_id(name, field, cache_dir, timeout_s)


def _looks_like_path(name: str) -> bool:
    """A folder, not a hub id: ``./x``, ``/x``, ``~/x``, ``a/b/c`` (hub ids have one ``/``), or ``a/b`` with ``a`` a folder here."""
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name):
        return True
    return "/" in name and os.path.isdir(name.split("/", 1)[0])


def _check_folder(name: str, field: str) -> str:
    path = Path(name).expanduser().absolute()
    if not path.exists():
        found = next((p for p in path.parents if p.exists()), None)
        where = f" ({found} exists, {path.relative_to(found)} does not)" if found is not None else ""
        raise ConfigError(f"{field}: no folder {path}{where}; from {name!r}, a local path (not a hub id)")
    if not path.is_dir():
        raise ConfigError(f"{field}: {path} is a file; give the model's folder (the one holding config.json)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{field}: the folder {path} has no config.json: not a Hugging Face model folder")
    return f"local folder {path}"


def _offline() -> Optional[str]:
    """The variable that makes this machine offline for the hub, if one does."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return var
    return None


def _check_hub_id(name: str, field: str, cache_dir: Optional[str], timeout_s: float) -> str:
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, HfHubHTTPError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ConfigError(
            f"{field}: {name!r} is no short name ({', '.join(SHORT_NAMES)}), no local folder and no valid hub id "
            "(org/name: letters, digits, '-', '_', '.')"
        ) from None
    cache = cache_dir or os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    cached = try_to_load_from_cache(name, "config.json", cache_dir=cache)
    if isinstance(cached, str):
        return f"hub id {name} (cached: {Path(cached).parent})"
    tried = f"{name!r} is no local folder and not in the hub cache {cache}"
    offline = _offline()
    if offline:
        raise ConfigError(f"{field}: {tried}, and {offline} is set (offline): download it first, or give a folder")
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    try:
        HfApi(endpoint=endpoint).model_info(name, timeout=timeout_s)
    except GatedRepoError:
        raise ConfigError(
            f"{field}: {name!r} is a gated model on {endpoint}: accept its terms there and log in (HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{field}: {tried}, and {endpoint} has no model {name!r} (a private one needs HF_TOKEN)"
        ) from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise ConfigError(f"{field}: {tried}, and {endpoint} answered HTTP {status} about it") from None
    except Exception as e:  # connection refused, DNS, timeout: the hub's HTTP client's own error types
        raise ConfigError(
            f"{field}: {tried}, and {endpoint} cannot be reached ({type(e).__name__}, timeout {timeout_s:g} s): "
            "offline? Download it first, or give a folder"
        ) from None
    return f"hub id {name} (on {endpoint}, not cached yet: downloaded when loaded)"
