"""Configs and helpers shared by the recipes."""

from training.utils.config import DeployConfig, TrainerConfig, WandBConfig
from training.utils.rl.losses.config import LossConfig

__all__ = ["DeployConfig", "TrainerConfig", "WandBConfig", "LossConfig"]
