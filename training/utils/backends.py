"""What each deployment backend (``DeployConfig.engine``) is and can do: the one table, ``BACKENDS``.

    backend("vllm").multi_gpu          # True: a replica may span several GPUs
    backend("sglang").sleep_levels     # (): it cannot sleep, so a colocated SGLang run is refused

Everything that depends on the backend reads a fact of this table, never its name:

| reader | facts |
| --- | --- |
| ``DeployConfig.__post_init__`` (``training/utils/config.py``: ``check_backend``) | the name; ``sleep_levels`` (``colocate``, ``sleep_level``); ``memory_settings`` (``gpu_memory_fraction``); ``engine_config_fields`` (every other ``EngineConfig`` field must stay at its default); ``distributed_weights`` (``weight_sync``) |
| ``make_deployment`` / ``make_sampler`` (``training/deployment/backends/registry.py``) | ``deployment``, ``sampler``, ``sampler_tokenizer`` |
| ``DeploymentGroup`` (``training/deployment/group.py``) | ``weight_sender`` (``weight_sync="distributed"``) |
| ``plan_placement`` (``training/deployment/placement.py``) | ``multi_gpu``; ``memory_settings`` and ``default_gpu_memory_fraction`` (replicas sharing a GPU) |
| the Ray launcher's server actor (``training/launch/server_actor.py``) | ``weight_peer_flag`` |
| the recipes (``resources.py``, ``teacher.py``) | ``reads("num_threads")`` (the CPU split); ``scores_prompts_alone`` (a teacher's ``max_tokens``) |

One memory setting per backend, and one meaning per setting (the other backends' setting is refused, naming it):

| backend | reads | passed as | what it sizes |
| --- | --- | --- | --- |
| ``embedded`` | ``engine_config.kv_cache_memory_bytes``, else ``engine_config.kv_cache_memory_fraction`` (0.1) | ``--engine-config JSON`` (``EngineConfig`` whole) | the KV block pool alone: those bytes, or that share of the memory free after the weights |
| ``vllm`` | ``gpu_memory_fraction`` (None: vLLM's 0.9) | ``--gpu-memory-utilization`` (GPU only) | the whole instance: weights, activations and KV cache, as a share of the GPU's memory |
| ``sglang`` | ``gpu_memory_fraction`` (None: SGLang's 0.88) | ``--mem-fraction-static`` | weights and KV pool, as a share of the GPU's memory |

Why the table lives on the ground floor rather than in ``training/deployment/backends/registry.py``: a
config is checked when it is built (``DeployConfig.__post_init__``, the one config mechanism), so an impossible
combination fails when the config is read, by any caller (a recipe, ``serve``, a script building a
``DeploymentGroup``); ``training/utils`` may not import ``training/deployment``. The facts are plain data and the
classes are named by ``module:Class`` strings, so this module imports nothing, and the registry imports a
backend's module only when that backend is deployed. Adding a backend is one entry here and its own module under
``training/deployment/backends/`` (training/deployment/README.md, "Adding a backend").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Backend:
    """One deployment backend's facts (the module docstring says who reads which)."""

    name: str
    """The ``DeployConfig.engine`` value that selects it."""
    deployment: str
    """``module:Class`` of its ``ServerProcess`` (launch, or attach by URL), imported by ``make_deployment``."""
    sampler: str
    """``module:Class`` of its sampler client (a ``DeploymentSampler``), imported by ``make_sampler``."""
    sampler_tokenizer: bool
    """Its sampler takes the model's tokenizer (``tokenizer=``: SGLang's renders chat prompts to ids locally)."""
    sleep_levels: tuple[int, ...]
    """The ``POST /sleep?level=N`` levels its server answers (``DeployConfig.sleep_level`` must be one under
    ``colocate``); empty: it cannot give its memory back while the trainer trains, so ``colocate`` is refused."""
    multi_gpu: bool
    """A replica may span several GPUs (a ``cuda:N,M`` entry of ``replica_devices``: tensor parallel)."""
    memory_settings: tuple[str, ...]
    """The settings that size its memory, as a ``DeployConfig`` names them (module docstring, second table)."""
    default_gpu_memory_fraction: Optional[float]
    """The share of a GPU one replica takes while ``gpu_memory_fraction`` is None (placement sums them per GPU);
    None: no fixed share (the embedded engine's KV pool is sized from the memory free at its start)."""
    engine_config_fields: Optional[frozenset[str]]
    """The ``EngineConfig`` fields it reads (None: every field, ``EngineConfig`` passed whole); any other field
    set away from its default is refused when the config is built, so no setting is silently ignored."""
    distributed_weights: bool
    """Takes ``weight_sync="distributed"`` (tensors broadcast over a torch.distributed group to servers attached
    by ``base_url``)."""
    scores_prompts_alone: bool
    """Answers a ``prompt_logprobs`` request with ``max_tokens: 0`` (nothing generated); False: one token is
    generated, so a teacher's ``max_model_len`` needs one more position."""
    weight_peer_flag: bool = False
    """Its server takes ``--weight-peer HOST`` (the hosts allowed to form a weight group with it: this package's
    server, ``training/deployment/serve.py``); the Ray launcher's server actors pass the trainer's node so."""
    weight_sender: str = "training.deployment.weights.distributed:DistributedWeightSender"
    """``module:Class`` of the trainer's sender for ``weight_sync="distributed"`` (read when ``distributed_weights``;
    built by ``DeploymentGroup`` with ``from_replicas``): this package's routes, or vLLM's ``/collective_rpc``."""

    def reads(self, engine_config_field: str) -> bool:
        """Whether this backend reads ``EngineConfig.<engine_config_field>``."""
        return self.engine_config_fields is None or engine_config_field in self.engine_config_fields


LAUNCH_FIELDS = frozenset({"device", "dtype", "max_batch_size", "max_model_len", "seed"})
"""The ``EngineConfig`` fields an external server is launched with: ``device`` through the placement
(``CUDA_VISIBLE_DEVICES``), the others as its own flags (context length, running requests, dtype, seed)."""

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            name="embedded",
            deployment="training.deployment.backends.embedded:EmbeddedDeployment",
            sampler="training.deployment.client:DeploymentSampler",
            sampler_tokenizer=False,
            sleep_levels=(1, 2),
            multi_gpu=False,
            memory_settings=("engine_config.kv_cache_memory_bytes", "engine_config.kv_cache_memory_fraction"),
            default_gpu_memory_fraction=None,
            engine_config_fields=None,
            distributed_weights=True,
            scores_prompts_alone=True,
            weight_peer_flag=True,
        ),
        Backend(
            name="vllm",
            deployment="training.deployment.backends.vllm:VLLMDeployment",
            sampler="training.deployment.client:DeploymentSampler",
            sampler_tokenizer=False,
            sleep_levels=(1, 2),
            multi_gpu=True,
            memory_settings=("gpu_memory_fraction",),
            default_gpu_memory_fraction=0.9,
            engine_config_fields=LAUNCH_FIELDS,
            distributed_weights=True,  # through its worker extension (backends/vllm_weights.py)
            scores_prompts_alone=False,
            weight_sender="training.deployment.backends.vllm_weights:VLLMWeightSender",
        ),
        Backend(
            name="sglang",
            deployment="training.deployment.backends.sglang:SGLangDeployment",
            sampler="training.deployment.backends.sglang:SGLangSampler",
            sampler_tokenizer=True,
            sleep_levels=(),  # SGLang's /release_memory_occupation is not wired here
            multi_gpu=True,
            memory_settings=("gpu_memory_fraction",),
            default_gpu_memory_fraction=0.88,
            engine_config_fields=LAUNCH_FIELDS,
            distributed_weights=False,
            scores_prompts_alone=False,
        ),
    )
}
"""Every backend, by its ``DeployConfig.engine`` name."""
