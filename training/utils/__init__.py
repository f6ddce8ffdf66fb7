"""Configs and helpers shared by the recipes."""

from training.utils.config import DeployConfig, EngineConfig, TrainerConfig, WandBConfig
from training.utils.rl.losses.config import LossConfig

__all__ = ["DeployConfig", "EngineConfig", "TrainerConfig", "WandBConfig", "LossConfig"]
