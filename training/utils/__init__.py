"""Configs and helpers shared by the recipes."""

from training.utils.config import (
    ConfigError,
    DeployConfig,
    EngineConfig,
    TensorBoardConfig,
    TrainerConfig,
    WandBConfig,
)
from training.utils.rl.losses.config import LossConfig

__all__ = [
    "ConfigError",
    "DeployConfig",
    "EngineConfig",
    "TrainerConfig",
    "WandBConfig",
    "TensorBoardConfig",
    "LossConfig",
]
