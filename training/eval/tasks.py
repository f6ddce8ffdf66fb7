"""What an evaluation rolls out: rows and the ``make_rollout_fn`` that scores them (``EvalTask``).

- ``jsonl_task(data, reward=None, rollout=None)``: rows from a ``.jsonl`` file. With ``reward``
  (``module:function`` or ``path.py:function``, called ``reward(completion_text, row)``) or neither, the
  recipes' built-in single-turn rollout samples each row's ``messages`` / ``prompt_token_ids`` / ``prompt``
  (``training/recipes/single_turn.py``; no ``reward``: exact match on the row's ``answer``). With
  ``rollout`` (a ``make_rollout_fn(setup)`` such as an example's ``rollout.py:make_rollout_fn``) the rows
  go through that rollout, exactly as in training.
- ``reasoning_gym_task(name, size, seed)``: a reasoning-gym dataset through
  ``training/envs/reasoning_gym_env.py`` (the library's questions and its own scorer).

Every mistake in these arguments raises ``EvalArgumentError``, one line naming the option.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


class EvalArgumentError(ValueError):
    """A command-line argument that cannot work: ``python -m training.eval`` prints it in one line, exit code 2."""


@dataclass
class EvalTask:
    """Rows, the rollout factory that scores them, and a JSON-able description for the report."""

    rows: list[dict]
    make_rollout_fn: Callable[[Any], Any]
    describe: dict = field(default_factory=dict)


def load_callable(spec: str, option: str) -> Callable:
    """``module:function`` (imported) or ``path.py:function`` (loaded from the file) as the callable it names."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise EvalArgumentError(f"{option}: give module:function or path.py:function, got {spec!r}")
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise EvalArgumentError(f"{option}: no such file {where} (in {spec!r})")
        module_name = f"_training_eval_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise EvalArgumentError(f"{option}: cannot load {where} as Python (in {spec!r})")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))  # its own imports of neighbour files (``from rollout import``)
        try:
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any failure of the user's file is one line naming it
            raise EvalArgumentError(f"{option}: loading {where} raised {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise EvalArgumentError(f"{option}: cannot import module {where!r} ({e})") from None
        except Exception as e:  # noqa: BLE001
            raise EvalArgumentError(f"{option}: importing {where} raised {type(e).__name__}: {e}") from None
    target = getattr(module, name, None)
    if target is None:
        raise EvalArgumentError(f"{option}: {where} has no {name!r}")
    if not callable(target):
        raise EvalArgumentError(f"{option}: {where}:{name} is a {type(target).__name__}, not a function")
    return target


def jsonl_task(data: str, reward: str | None = None, rollout: str | None = None) -> EvalTask:
    """Rows of ``data`` scored by ``reward`` through the built-in rollout, or by ``rollout`` (see the module)."""
    from training.utils.data import load_rows

    if reward and rollout:
        raise EvalArgumentError("--reward, --rollout: give one (a rollout scores its own completions)")
    path = Path(data)
    if not path.is_file():
        raise EvalArgumentError(f"--data: no such file {data}; give a .jsonl file (one JSON object per line)")
    try:
        rows = load_rows(path)
    except ValueError as e:
        raise EvalArgumentError(f"--data: {e}") from None
    if not rows:
        raise EvalArgumentError(f"--data: {data} holds no rows")
    if rollout:
        factory = load_callable(rollout, "--rollout")
        how = {"rollout": rollout}
    else:
        from training.recipes.single_turn import make_single_turn_rollout_fn

        reward_fn = load_callable(reward, "--reward") if reward else None
        factory = make_single_turn_rollout_fn(reward_fn)
        how = {"reward": reward or "exact_match_reward"}
    return EvalTask(rows, factory, {"kind": "jsonl", "data": str(path), "rows": len(rows), **how})


def reasoning_gym_task(name: str, size: int, seed: int) -> EvalTask:
    """``size`` entries of reasoning-gym's ``name`` dataset (seeded), scored by the library."""
    try:
        import reasoning_gym  # noqa: F401 - only to say in one line that it is missing
    except ImportError:
        raise EvalArgumentError('--reasoning-gym: reasoning-gym is not installed: pip install -e ".[envs]"') from None
    from training.envs.reasoning_gym_env import (
        make_reasoning_gym_rollout_fn,
        reasoning_gym_dataset,
        reasoning_gym_rows,
    )

    if size < 1:
        raise EvalArgumentError(f"--size: must be >= 1, got {size}")
    try:
        dataset = reasoning_gym_dataset(name, size=size, seed=seed)
    except Exception as e:  # noqa: BLE001 - the library's refusal (an unknown name, a bad setting) in one line
        raise EvalArgumentError(f"--reasoning-gym: {name!r}: {type(e).__name__}: {e}") from None
    rows = reasoning_gym_rows(dataset)
    return EvalTask(
        rows,
        make_reasoning_gym_rollout_fn(dataset),
        {"kind": "reasoning_gym", "name": name, "size": size, "data_seed": seed, "rows": len(rows)},
    )
