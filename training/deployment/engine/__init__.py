"""Generation engine: continuous batching over a pool of KV blocks, prefix caching, in-flight weight updates.

    from training.deployment.engine import AsyncEngine, EngineConfig, SamplingParams
    engine = AsyncEngine(EngineConfig(model="path/to/hf_folder"))
    await engine.start()
    result = await engine.generate([1, 2, 3], SamplingParams(max_tokens=8, temperature=0))

See README.md in this folder for the file map and invariants.
"""

from training.deployment.engine.async_engine import AsyncEngine
from training.deployment.engine.requests import (
    EngineBusyError,
    EngineDeadError,
    EngineConfig,
    EngineError,
    GenerationResult,
    SamplingParams,
    WeightUpdateError,
)

__all__ = [
    "AsyncEngine",
    "EngineBusyError",
    "EngineDeadError",
    "EngineConfig",
    "EngineError",
    "GenerationResult",
    "SamplingParams",
    "WeightUpdateError",
]
