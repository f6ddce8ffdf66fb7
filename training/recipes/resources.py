"""What a run takes in and hands out around its loop, resolved from ``Config``.

- ``check_run_inputs``: what can be checked in seconds before anything loads: ``base_model``
  (``training/models/resolve.py``), the distillation teacher's name, the ``dataset`` / ``eval_rows`` files,
  and the trackers' packages (wandb, TensorBoard).
- ``resolve_rows``: the rows given to ``main``, else ``cfg.dataset``; the first ``cfg.max_rows``.
- ``resolve_rollout_factory``: the user's ``make_rollout_fn``, else the built-in single-turn
  rollout scored by ``cfg.reward_fn`` (``single_turn.py``).
- ``rollout_tokenizer``: ``deployment.tokenizer_model`` (default: the policy's own tokenizer),
  checked against the model's vocabulary.
- ``promote_final_model``: ``output_model_id`` → a copy of the exported Hugging Face folder.
- ``log_start_notes``: the served model's name, and the settings that only a hosted service
  uses (accepted so documented configs run unchanged; no local effect).
- ``cpu_share``: how the trainer and the embedded servers split the cores when both run on this CPU.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

from training.launch.replicas import under_ray
from training.models import resolve_model
from training.models.resolve import check_base_model
from training.recipes.config import Config
from training.recipes.single_turn import make_single_turn_rollout_fn
from training.utils import dist
from training.utils.config import ConfigError, backend
from training.utils.data import Rows, load_rows
from training.utils.device import resolve_device
from training.utils.engine_choice import resolve_engine
from training.utils.metrics import check_trackers

logger = logging.getLogger("training.recipe")


def check_run_inputs(cfg: Config) -> None:
    """Fail in seconds, before rows, models or servers load, on a ``base_model`` that names nothing usable, a
    ``dataset`` / ``eval_rows`` file that does not exist, or a tracker whose package is missing: one ``ConfigError``
    line each. Logs what the model name is and the trackers."""
    logger.info("base_model: %s", check_base_model(cfg.base_model))
    if cfg.distillation.teacher_model is not None:
        teacher = check_base_model(cfg.distillation.teacher_model, field="distillation.teacher_model")
        logger.info("distillation.teacher_model: %s", teacher)
    for name in ("dataset", "eval_rows"):  # a data file that is not there, found before the model loads
        path = getattr(cfg, name)
        if isinstance(path, (str, Path)) and not Path(path).is_file():
            raise ConfigError(f"{name}: no such file {path}; give the path of a .jsonl file (one JSON object per line)")
    trackers = check_trackers(cfg.wandb, cfg.tensorboard)
    logger.info("trackers: metrics.jsonl%s", "".join(f", {t}" for t in trackers))


def resolve_rows(cfg: Config, rows: Optional[Rows]) -> list[dict]:
    """``rows`` (a list or a .jsonl path) or else ``cfg.dataset``, loaded; at most ``cfg.max_rows`` of them."""
    if rows is not None and cfg.dataset is not None:
        raise ValueError(f"rows: main() got rows and cfg.dataset={cfg.dataset!r} is set too; give one of them")
    if rows is None and cfg.dataset is None:
        raise ValueError("rows: main() got no rows and cfg.dataset is None; pass rows=... or set Config(dataset=...)")
    loaded = load_rows(rows if rows is not None else cfg.dataset)
    return loaded[: cfg.max_rows] if cfg.max_rows is not None else loaded


def resolve_rollout_factory(cfg: Config, rollout_fn_factory: Optional[Any]) -> Any:
    """The user's ``make_rollout_fn``, or the built-in single-turn rollout with ``cfg.reward_fn``."""
    if rollout_fn_factory is not None:
        return rollout_fn_factory
    logger.info(
        "no rollout_fn_factory given: the built-in single-turn rollout, reward %s",
        getattr(cfg.reward_fn, "__name__", "exact_match_reward"),
    )
    return make_single_turn_rollout_fn(cfg.reward_fn)


def rollout_tokenizer(cfg: Config, model_path: str, policy_tokenizer: Any, vocab_size: int) -> Any:
    """The tokenizer rollouts use: ``deployment.tokenizer_model`` (loaded with ``AutoTokenizer``) or the policy's.

    Raises ``ValueError`` naming ``deployment.tokenizer_model`` when its ids do not fit the model's
    ``vocab_size`` embedding rows (the deployment serves the same model, so it could not read them).
    """
    name = cfg.deployment.tokenizer_model
    if name is None:
        return policy_tokenizer
    path = resolve_model(name)
    if os.path.realpath(path) == os.path.realpath(model_path):
        return policy_tokenizer
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"deployment.tokenizer_model: cannot load a tokenizer from {name!r}: {e}") from None
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"deployment.tokenizer_model: {name!r} has {len(tokenizer)} tokens, more than the vocabulary "
            f"of the deployed model {cfg.base_model!r} ({vocab_size}); use the base model's tokenizer"
        )
    logger.info("rollout tokenizer: %s (%d tokens; model vocabulary %d)", name, len(tokenizer), vocab_size)
    return tokenizer


def promote_final_model(final: Path, cfg: Config, log_path: Path) -> Path:
    """Copy the exported folder ``final`` to ``cfg.output_model_id``: ``<log_path>/<id>``, or the path itself when it
    contains a '/'. Replaces an older promotion there; returns the destination as an absolute path."""
    name = cfg.output_model_id
    dest = (Path(name).expanduser() if "/" in name else log_path / name).resolve()
    if dest == Path(final).resolve():
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(final, dest)
    logger.info("promoted the final policy as %r: %s", name, dest)
    return dest


def resolve_engines(cfg: Config, main_rank: bool = True) -> Config:
    """``cfg`` with ``deployment.engine`` and ``distillation.deployment.engine`` decided where they are ``auto``
    (training/utils/engine_choice.py), the choice logged in one line each on the main rank where there is one."""
    deployment, choice = resolve_engine(cfg.deployment)
    teacher, teacher_choice = resolve_engine(cfg.distillation.deployment)
    if main_rank:
        for prefix, c in (("", choice), ("teacher ", teacher_choice)):
            if c.line:
                logger.info("%s%s", prefix, c.line)
    return replace(cfg, deployment=deployment, distillation=replace(cfg.distillation, deployment=teacher))


def log_start_notes(cfg: Config, model_path: str) -> None:
    """Log the served model's name and each hosted-only setting that has no local effect."""
    if cfg.deployment.deployment_id:
        logger.info("deployment %r serves %s", cfg.deployment.deployment_id, model_path)
    if cfg.trainer.training_shape_id:
        logger.info(
            "trainer.training_shape_id=%r is a hosted training shape: no local effect here (device=%s)",
            cfg.trainer.training_shape_id,
            cfg.trainer.device,
        )


@dataclass
class CpuShare:
    """Threads of the trainer and of each embedded server when they share this machine's cores."""

    engine_threads: int
    """``EngineConfig.num_threads`` of each server."""
    trainer_threads_busy: int
    """The trainer's threads while rollouts are in flight (the servers generate meanwhile)."""
    trainer_threads_idle: int
    """The trainer's threads while no rollout is in flight: every core."""


def cpu_share(cfg: Config, overlaps: bool) -> Optional[CpuShare]:
    """The core split of a run whose trainer and servers run on this CPU at the same time, else None (servers of a
    backend that takes ``EngineConfig.num_threads``: the embedded one; training/utils/backends.py).

    They run at the same time when the loop ``overlaps`` generation with training (``async_rl_loop`` with
    ``max_head_offpolicy_versions > 0``). Two OpenMP thread pools that each spin on every core slow each other down
    several times over (training/recipes/README.md, "CPU threads"), so:
    - each server gets ``engine_config.num_threads`` when set, else half the cores split over the replicas (at
      least 1 each);
    - the trainer gets ``trainer.num_threads`` when set (fixed), else every core while no rollout is in flight and
      the cores the servers leave (at least 1) while one is.
    "Every core" is torch's thread count in this process (one per physical core, or ``OMP_NUM_THREADS``). Without
    overlap each side uses every core in its turn (or its own ``num_threads``). Under the Ray launcher the cores
    are split by the bundles each part reserved, so there is no share here.
    """
    dcfg = cfg.deployment
    if (
        not overlaps
        or dcfg.base_url is not None
        or not backend(dcfg.engine).reads("num_threads")
        or dist.is_distributed()
        or under_ray()  # each part's CPUs are its Ray bundle's (training/launch/bundles.py)
        or resolve_device(cfg.trainer.device).type != "cpu"
        or dcfg.engine_config.resolve_device().type != "cpu"
    ):
        return None
    cores = torch.get_num_threads()
    engine_threads = dcfg.engine_config.num_threads or max(1, cores // 2 // dcfg.num_replicas)
    busy = cfg.trainer.num_threads or max(1, cores - engine_threads * dcfg.num_replicas)
    return CpuShare(engine_threads, busy, cfg.trainer.num_threads or cores)
