"""Chat templates (Jinja) of the tool-calling model families, one file per ``tool_parsers`` family name.

Written for this package from each family's published format, small and faithful to what the model emits, so
tests can render real ``apply_chat_template`` output of every family on the tiny model (whose own template is
the Hermes one), and a tiny model can be served with another family's template (``install_template``).
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parent
FAMILIES = tuple(sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja")))
"""The family names with a template here (each a ``tool_parsers.PARSERS`` name)."""


def family_template(family: str) -> str:
    """The Jinja text of ``family``'s chat template; ValueError naming the families there are."""
    if family not in FAMILIES:
        raise ValueError(f"chat template: {family!r} is not one of {list(FAMILIES)}")
    return (TEMPLATES_DIR / f"{family}.jinja").read_text()


def install_template(model_dir: str | Path, family: str) -> None:
    """Make ``family``'s template the chat template of the Hugging Face folder ``model_dir`` (written as
    ``chat_template.jinja``; a ``chat_template`` in ``tokenizer_config.json``, which would win, is removed)."""
    folder = Path(model_dir)
    (folder / "chat_template.jinja").write_text(family_template(family))
    config = folder / "tokenizer_config.json"
    if config.exists():
        data = json.loads(config.read_text())
        if data.pop("chat_template", None) is not None:
            config.write_text(json.dumps(data, indent=2))
