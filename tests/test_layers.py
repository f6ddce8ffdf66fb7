"""The import graph points one way: examples, benchmarks → recipes → envs → trainer, deployment, agents, proxy →
utils, openai_api, models. Every import counts, lazy ones inside functions too (a lazy import that hides a cycle is
still a cycle), so the check reads the source instead of importing it."""

import ast
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
FLOORS = {
    "training": 0,  # the empty top package
    "training.utils": 0,
    "training.openai_api": 0,  # the OpenAI protocol, shared by the server and the proxy
    "training.models": 0,
    "training.trainer": 1,
    "training.deployment": 1,
    "training.agents": 1,
    "training.proxy": 1,
    "training.launch": 1.5,  # the Ray launcher: trainer ranks and replicas as actors, built on deployment
    "training.envs": 1.5,  # adapters of environment libraries, built on agents
    "training.rewards": 1.5,  # judge and rubric rewards, built on deployment
    "training.recipes": 2,
    "training.examples": 3,
    "training.plot": 3,
    "training.eval": 3,  # offline evaluation, built on recipes and deployment
    "training.memory_plan": 3,
    "benchmarks": 3,
}


def floor_of(module: str) -> int:
    for prefix, floor in sorted(FLOORS.items(), key=lambda kv: -len(kv[0])):  # the longest prefix wins
        if module == prefix or module.startswith(prefix + "."):
            return floor
    raise AssertionError(f"{module}: not on any floor; add its package to FLOORS")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    files = list((ROOT / "training").rglob("*.py")) + list((ROOT / "benchmarks").rglob("*.py"))
    return {module_name(p): p for p in files}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``path`` imports anywhere in its body (``from a import b`` counts ``a.b`` if a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            ]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in ("training", "benchmarks"))
    return found


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {m: {i for i in imports_of(p, modules) if i in modules and i != m} for m, p in modules.items()}


def test_no_module_imports_a_higher_floor():
    upward = sorted(
        f"{m} (floor {floor_of(m)}) imports {i} (floor {floor_of(i)})"
        for m, targets in graph().items()
        for i in targets
        if floor_of(i) > floor_of(m)
    )
    assert not upward, "\n".join(upward)


ONLY_IMPORTS = {
    "training.openai_api": {"training.openai_api"},
    "training.utils": {"training.utils", "training.openai_api"},
    "training.models": {"training.models", "training.utils"},
    "training.trainer": {"training.trainer", "training.utils"},
    "training.deployment": {"training.deployment", "training.utils", "training.openai_api"},
    "training.proxy": {"training.proxy", "training.utils", "training.openai_api"},
    "training.agents": {"training.agents", "training.utils", "training.openai_api", "training.models"},
    "training.envs": {"training.envs", "training.agents", "training.utils", "training.openai_api", "training.models"},
    "training.launch": {"training.launch", "training.deployment", "training.utils", "training.openai_api"},
    "training.rewards": {
        "training.rewards",
        "training.deployment",
        "training.utils",
        "training.openai_api",
        "training.models",
    },
}
"""The packages each package may import (itself included): the top README's layering table, checked against it."""


def test_packages_import_only_what_the_readme_says():
    def package(m: str) -> str:
        return ".".join(m.split(".")[:2])

    stray = sorted(
        f"{m} imports {i} (allowed: {sorted(ONLY_IMPORTS[package(m)])})"
        for m, targets in graph().items()
        if package(m) in ONLY_IMPORTS
        for i in targets
        if package(i) not in ONLY_IMPORTS[package(m)]
    )
    assert not stray, "\n".join(stray)


def test_floor_one_packages_do_not_import_each_other():
    """trainer, deployment, agents and proxy are siblings: what two of them need lives on the ground floor."""

    def package(m: str) -> str:
        return ".".join(m.split(".")[:2])

    crossing = sorted(
        f"{m} imports {i}"
        for m, targets in graph().items()
        if floor_of(m) == 1
        for i in targets
        if floor_of(i) == 1 and package(i) != package(m)
    )
    assert not crossing, "\n".join(crossing)


def test_import_graph_has_no_cycle():
    g = graph()
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_server_and_the_ground_floor_load_without_higher_floors():
    """Importing the inference server loads neither agents, proxy, trainer nor recipes (checked for real)."""
    code = (
        "import sys, training.deployment.server.app, training.utils.rl.ppo, training.utils.checkpoint; "
        "bad = [m for m in sys.modules if m.startswith(('training.agents', 'training.proxy', "
        "'training.trainer', 'training.recipes'))]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_readme_layering_table_is_only_imports():
    """The top README's table of what each package may import says exactly ``ONLY_IMPORTS``."""
    import re

    text = (ROOT / "README.md").read_text()
    table = text[text.index("Imports point one way") :].split("\n\n")[1]
    stated = {}
    for row in table.splitlines()[2:]:
        package, imports = (cell.strip() for cell in row.strip("|").split("|"))
        name = re.match(r"`(\w+)`", package).group(1)
        stated[f"training.{name}"] = {f"training.{n}" for n in re.findall(r"`(\w+)`", imports)} | {f"training.{name}"}
    assert stated == ONLY_IMPORTS
