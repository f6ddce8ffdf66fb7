"""Which weights an evaluation serves: ``resolve_target(spec, step)`` and ``materialize(target, folder)``.

A model spec is one of:

- a model folder or a hub id (anything ``from_pretrained`` loads; checked by ``check_base_model``);
- a run's ``log_path`` (a folder whose ``config.json`` names a ``base_model``): its exported ``final/`` folder;
- a run's ``log_path`` with a step (``--step 10``, or ``<log_path>@10``): checkpoint ``step_000010`` of
  ``<log_path>/checkpoints``. The base model is loaded with the run's trainer settings, the DCP
  checkpoint loaded into it (``load_checkpoint``, the recipes' resume path; LoRA adapters merged), and
  the weights written once as a plain folder that the server loads like any other.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from training.eval.tasks import EvalArgumentError

RUN_CONFIG = "config.json"


@dataclass(frozen=True)
class Target:
    """One model to evaluate: a folder or hub id to serve, or a run's checkpoint to export first."""

    spec: str
    """What the user gave."""
    model: str
    """The folder or hub id the server loads (for a checkpoint: the run's base model)."""
    run: Optional[str] = None
    """The run folder, when the spec names a run."""
    step: Optional[int] = None
    """The checkpoint step, when the spec names one."""

    def describe(self) -> dict:
        return {"spec": self.spec, "model": self.model, "run": self.run, "step": self.step}


def run_config(folder: Path) -> Optional[dict]:
    """A run's recorded config (``<log_path>/config.json`` with a ``base_model``), or None for other folders."""
    path = folder / RUN_CONFIG
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) and "base_model" in cfg else None


def split_step(spec: str) -> tuple[str, Optional[int]]:
    """``runs/x@10`` -> (``runs/x``, 10); a spec without ``@<digits>`` is returned whole."""
    head, sep, tail = spec.rpartition("@")
    if sep and head and tail.isdigit():
        return head, int(tail)
    return spec, None


def resolve_target(spec: str, step: Optional[int] = None, option: str = "model") -> Target:
    """The ``Target`` a spec names (see the module docstring); ``EvalArgumentError`` naming ``option`` if none."""
    from training.models import resolve_model
    from training.models.resolve import check_base_model
    from training.utils.checkpoint_files import checkpoint_steps, verify_checkpoint
    from training.utils.config import ConfigError

    name, at = split_step(spec)
    if at is not None and step is not None and at != step:
        raise EvalArgumentError(f"{option}: {spec!r} names step {at} and --step says {step}")
    step = at if at is not None else step
    folder = Path(name)
    cfg = run_config(folder) if folder.is_dir() else None
    if cfg is None:
        if step is not None:
            raise EvalArgumentError(
                f"{option}: a step needs a run folder (a log_path with config.json); {name!r} is not"
            )
        try:
            check_base_model(name, field=option)
        except ConfigError as e:
            raise EvalArgumentError(str(e)) from None
        return Target(spec, resolve_model(name))
    if step is None:
        final = folder / "final"
        if not (final / "config.json").is_file():
            steps = checkpoint_steps(folder / "checkpoints")
            raise EvalArgumentError(
                f"{option}: run {name} has no exported final/ folder; give a checkpoint step (--step N or {name}@N)"
                + (f", one of {steps}" if steps else "")
            )
        return Target(spec, str(final), run=str(folder))
    ckpt = folder / "checkpoints" / f"step_{step:06d}"
    problem = verify_checkpoint(ckpt)
    if problem is not None:
        steps = checkpoint_steps(folder / "checkpoints")
        raise EvalArgumentError(
            f"{option}: run {name} has no usable checkpoint at step {step} ({problem}); its checkpoints: {steps or 'none'}"
        )
    try:
        check_base_model(cfg["base_model"], field=f"{option} (the run's base_model)")
    except ConfigError as e:
        raise EvalArgumentError(str(e)) from None
    return Target(spec, resolve_model(cfg["base_model"]), run=str(folder), step=step)


def materialize(target: Target, folder: Path) -> str:
    """The folder or hub id the server loads: ``target.model``, or for a checkpoint its weights exported into ``folder``.

    The run's trainer settings rebuild the model (LoRA included) on the run's device; the optimizer is built only
    because the checkpoint holds its state too. The learning-rate schedule is not needed and is left constant.
    """
    if target.step is None:
        return target.model
    from training.trainer import PolicyTrainer
    from training.utils.checkpoint import load_checkpoint
    from training.utils.config import TrainerConfig

    run = Path(target.run)
    recorded = run_config(run).get("trainer", {})
    known = {f.name for f in dataclasses.fields(TrainerConfig)}
    settings = {k: (tuple(v) if k == "adam_betas" else v) for k, v in recorded.items() if k in known}
    settings.update(lr_schedule="constant", warmup_steps=0)
    trainer = PolicyTrainer(target.model, TrainerConfig(**settings))
    load_checkpoint(run / "checkpoints" / f"step_{target.step:06d}", trainer.model, trainer.optimizer)
    out = trainer.save_pretrained(folder, adapters=False)
    del trainer
    return str(out)
