"""Sub-configs shared by the recipes: the trainer, the inference engine, the deployment, the trackers
(wandb, TensorBoard) and the recording proxy's deadlines.

Plain dataclasses, validated in ``__post_init__``: a bad value fails at construction with a
``ConfigError`` that names the field and says what is allowed. Each field's docstring is its help text.
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Optional, Union

from training.utils.backends import BACKENDS, Backend
from training.utils.device import DEVICES, DTYPES, is_device_name, resolve_device, resolve_dtype
from training.openai_api.tool_parsers.registry import TOOL_CALL_PARSERS

WEIGHT_SYNC_MODES = ("auto", "shm", "disk", "distributed")
INFLIGHT_UPDATE_KV = ("keep", "recompute")
DECODE_KERNELS = ("auto", "native", "torch")
LR_SCHEDULES = ("constant", "linear", "cosine")
"""Names ``TrainerConfig.lr_schedule`` accepts (the formulas: training/trainer/lr_schedule.py)."""


class ConfigError(ValueError):
    """A setting a run cannot use, in one line that names it (``"base_model: ..."``): a usage error, not a bug.

    Raised by config validation and by the checks a run makes before anything loads
    (``training/models/resolve.py``, ``training/utils/metrics.py``: ``check_trackers``); a recipe's
    command line prints it without a traceback. A ``ValueError``, so ``except ValueError`` catches it too.
    """


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {message}")


def backend(name: str) -> Backend:
    """The facts of deployment backend ``name`` (``BACKENDS``, training/utils/backends.py); a ``ConfigError``
    naming the allowed names when there is no such backend."""
    _check(
        isinstance(name, str) and (name in BACKENDS or name == "auto"),
        "engine",
        f"{name!r} is not 'auto' or one of {tuple(BACKENDS)}",
    )
    return BACKENDS["embedded" if name == "auto" else name]  # "auto" unresolved: see training/utils/engine_choice.py


def _is_replica_device(value: str) -> bool:
    """``cpu``, ``cuda:N`` or ``cuda:N,M,...`` (distinct GPU indices)."""
    if value == "cpu":
        return True
    if not value.startswith("cuda:"):
        return False
    ids = value[5:].split(",")
    return all(i.isdigit() for i in ids) and len(set(ids)) == len(ids)


def _check_device(name: str, value: str) -> None:
    _check(is_device_name(value), name, f"{value!r} is not one of {DEVICES} or 'cuda:N'")


def _check_threads(value: Optional[int]) -> None:
    _check(
        value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
        "num_threads",
        f"must be a positive integer or None (torch's default), got {value!r}",
    )


@dataclass
class TrainerConfig:
    """The policy trainer: optimizer and how batches are executed."""

    learning_rate: float = 1e-5
    """AdamW learning rate (> 0); the peak of ``lr_schedule``."""
    lr_schedule: str = "constant"
    """How the learning rate moves over the optimizer steps, after ``warmup_steps`` of linear warm-up:
    ``constant``, ``linear`` (down to 0 at the run's end) or ``cosine`` (half a cosine down to 0 at the run's end).
    The end is the recipe's ``max_steps`` (times ``ppo_epochs * ppo_mini_batches`` optimizer steps per step), so
    ``linear`` and ``cosine`` need ``max_steps``. The position is saved in checkpoints: a resumed run continues it."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up: step s < W trains at ``learning_rate * (s + 1) / W`` (0 = none)."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    weight_decay: float = 0.01
    """AdamW weight decay (>= 0)."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm to this value before each optimizer step (0 = no clipping)."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch; samples are packed without padding up to it (with
    ``shared_prompt_packing`` the budget counts computed tokens: a shared prompt counts once)."""
    shared_prompt_packing: bool = True
    """Compute a prompt that several samples start with (a GRPO group's) once per micro-batch instead of once per
    sample, in forward and backward: the group's samples attend to one copy of it. Groups are found from the token
    ids; logprobs and gradients equal the ordinary packing's (fp32: to 1e-5). Used where it is exact: ``packed_sdpa``
    attention and no sliding-window layers; other models fall back to ordinary packing (logged)."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk when turning hidden states into logprobs (bounds the fp32 vocab-sized buffer)."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "auto"
    """Parameter dtype, the copy AdamW updates: ``auto`` is float32 (bfloat16 weights silently drop small updates).
    With LoRA, ``auto`` holds the frozen base in ``compute_dtype`` (bf16 on CUDA) and the adapters in float32."""
    compute_dtype: str = "auto"
    """Autocast dtype of the trainer's forward and backward passes: ``auto`` is bfloat16 on CUDA and float32 (no
    autocast) on CPU. ``bfloat16`` on CPU is the opt-in mixed-precision path: matmuls in bf16 (AMX / AVX-512 BF16
    where the CPU has them), the master weights, gradients and AdamW state stay in ``dtype`` (float32), attention and
    the LM head's log-softmax run in fp32. Logprobs then differ from fp32's by a few hundredths (SmolLM2: mean
    |Δ logprob| about 0.03); speed and gap are in training/trainer/README.md, "bf16 autocast". The reference model
    (``kl_beta > 0``) is held in this dtype."""
    gradient_checkpointing: Optional[bool] = None
    """Recompute activations in the backward pass (per decoder layer) to save memory, at about a third more compute.
    None: the recipe decides at start from the memory plan (``training/recipes/memory_plan.py``): on CUDA, on only
    when the run would not fit without it; on CPU, off. ``trainer.gradient_checkpointing=true/false`` decides."""
    reference_device: str = "auto"
    """Where the frozen reference model (``kl_beta > 0``) lives: ``auto`` = the policy's device. With LoRA the reference
    is the policy's own base weights with the adapters switched off (no second copy), so this does not apply."""
    seed: int = 0
    """Seed for torch's RNG in the trainer."""
    num_threads: Optional[int] = None
    """CPU threads of the trainer's torch ops (intra-op). None: torch's default (one per core), except that a recipe
    whose embedded server generates on the same CPU while the trainer trains splits the cores between the two
    (see training/recipes/README.md, "CPU threads"). Ignored on GPU."""
    training_shape_id: Optional[str] = None
    """A hosted service's training shape (Fireworks: ``accounts/<a>/trainingShapes/<s>``). Accepted so documented
    configs run unchanged, and logged at start; it has no local effect (``device`` and ``dtype`` decide here)."""
    offload_optimizer: bool = False
    """Move AdamW's state (the two moments) to host memory after each optimizer step and back before the next, so
    a colocated engine (``deployment.colocate``) has that memory while it generates. A no-op on CPU."""
    lora_rank: int = 0
    """LoRA rank r: 0 trains every weight (full fine-tuning); r > 0 freezes the base weights and trains adapters
    ``W + (lora_alpha / r)·BA`` on ``lora_target_modules`` (needs ``peft``: ``pip install -e '.[lora]'``). Weight
    sync, export and the reference model see merged weights; checkpoints hold the adapters and their optimizer state.
    LoRA wants a higher ``learning_rate`` than full fine-tuning (about 10x; see training/trainer/README.md)."""
    lora_alpha: float = 32.0
    """LoRA scale numerator: adapters are scaled by ``lora_alpha / lora_rank``."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input. Keep 0 for RL: with dropout the trainer's logprobs are random, so the PPO ratio
    to the step's starting weights is not 1 before the first update."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names (suffixes) that get adapters, e.g. ``["q_proj", "v_proj"]``; ``["all-linear"]`` = every linear
    layer of the decoder (attention and MLP), not the LM head. Linear layers only."""
    lora_save_adapters: bool = False
    """Also write the adapters alone (``peft`` format, ``<export folder>/adapter``) when the final policy is exported;
    the export folder itself always holds the merged weights."""

    def __post_init__(self):
        _check(self.learning_rate > 0, "learning_rate", f"must be > 0, got {self.learning_rate}")
        _check(self.lr_schedule in LR_SCHEDULES, "lr_schedule", f"{self.lr_schedule!r} is not one of {LR_SCHEDULES}")
        _check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0 (0 = no warm-up), got {self.warmup_steps}")
        _check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check(self.grad_clip_norm >= 0, "grad_clip_norm", f"must be >= 0 (0 = off), got {self.grad_clip_norm}")
        _check(
            len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
            "adam_betas",
            f"must be two values in [0, 1), got {self.adam_betas}",
        )
        _check(self.micro_batch_tokens > 0, "micro_batch_tokens", f"must be > 0, got {self.micro_batch_tokens}")
        _check(self.logprob_chunk_tokens > 0, "logprob_chunk_tokens", f"must be > 0, got {self.logprob_chunk_tokens}")
        _check_threads(self.num_threads)
        _check(self.dtype in DTYPES, "dtype", f"{self.dtype!r} is not one of {DTYPES}")
        _check(self.compute_dtype in DTYPES, "compute_dtype", f"{self.compute_dtype!r} is not one of {DTYPES}")
        _check_device("device", self.device)
        _check_device("reference_device", self.reference_device)
        _check(self.lora_rank >= 0, "lora_rank", f"must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        _check(self.lora_alpha > 0, "lora_alpha", f"must be > 0, got {self.lora_alpha}")
        _check(0 <= self.lora_dropout < 1, "lora_dropout", f"must be in [0, 1), got {self.lora_dropout}")
        _check(
            isinstance(self.lora_target_modules, (list, tuple))
            and len(self.lora_target_modules) > 0
            and all(isinstance(m, str) and m for m in self.lora_target_modules),
            "lora_target_modules",
            f"must be a non-empty list of module names, got {self.lora_target_modules!r}",
        )


@dataclass
class EngineConfig:
    """How the inference engine loads the model, sizes its KV cache and runs its steps.

    The one declaration of engine settings: ``DeployConfig.engine_config`` nests it, the launcher
    hands it to the server process whole (``serve.py --engine-config JSON``; ``serve.py``'s own
    flags are generated from these fields), and ``AsyncEngine`` takes it as is.
    """

    model: Optional[str] = None
    """Local Hugging Face folder (or a hub id, which uses the transformers fallback). Inside a
    ``DeployConfig`` leave it None: the recipe serves ``base_model``."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "auto"
    """``auto`` is bfloat16 on CUDA and float32 on CPU; or ``float32`` / ``bfloat16`` / ``float16``."""
    max_batch_size: int = 64
    """Most sequences decoded at once (the running batch; more requests wait). Not a memory setting: the KV
    cache is a pool of blocks sized by ``kv_cache_memory_bytes`` / ``kv_cache_memory_fraction``."""
    max_model_len: int = 2048
    """Longest prompt + completion, in tokens (a sequence takes KV blocks only for the tokens it holds)."""
    kv_cache_memory_bytes: Optional[int] = None
    """Bytes of the KV cache's block pool (K and V of every layer). None: ``kv_cache_memory_fraction`` sizes it.
    A request that alone could never fit the pool is refused with a 400 naming this setting. Embedded engine only
    (vLLM / SGLang size their memory by ``DeployConfig.gpu_memory_fraction`` and refuse this one)."""
    kv_cache_memory_fraction: float = 0.1
    """With ``kv_cache_memory_bytes`` None: the pool takes this share of the memory free at start-up on the
    engine's device (MemAvailable on CPU, CUDA's free memory after the weights on a GPU), and never more than
    ``max_batch_size`` x ``max_model_len`` tokens' worth. On CPU pool pages become resident as blocks are first
    used. Embedded engine only (vLLM / SGLang refuse it set away from this default)."""
    kv_block_size: int = 16
    """Tokens per KV cache block (a multiple of 16: the C decode step attends 16 keys per vector)."""
    max_waiting: int = 4096
    """Most sequences queued for admission (a request with ``n`` choices queues ``n``). Past it a new request
    gets a 503 with ``Retry-After`` (the server's busy answer); requests already accepted are never dropped,
    and a request is always accepted while nothing waits."""
    seed: Optional[int] = None
    """Seeds the per-request generators of requests that bring no seed of their own. ``None``: a
    recipe's run uses its own ``seed`` (so runs with different seeds sample differently), a server
    started by hand uses 0; replica ``i`` of a group adds ``i``."""
    num_threads: Optional[int] = None
    """CPU threads of the engine's forward passes (torch intra-op). None: torch's default (one per core), except
    that a recipe whose trainer trains on the same CPU while this server generates gives it its share of the cores
    (see training/recipes/README.md, "CPU threads"). Embedded engine only; ignored on GPU."""
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    """Decode batch buckets captured as CUDA graphs (clipped to ``max_batch_size``); empty = eager."""
    use_lean_forward: bool = True
    """Own forward for llama / qwen2 / qwen3 (fused projections); else transformers' forward."""
    max_prefill_tokens: int = 4096
    """Prompt tokens prefilled in one step (a longer single prompt still runs, alone)."""
    enable_prefix_caching: bool = True
    """Share the KV blocks of any cached prompt prefix across requests (no session id needed); False: sessions
    only."""
    inflight_update_kv: str = "keep"
    """An update with ``wait_for_inflight=False``: running sequences ``keep`` their K/V (PipelineRL), or
    ``recompute`` it under the new weights before the next decode step."""
    decode_kernel: str = "auto"
    """The lean forward's decode step on CPU in fp32 or bf16: ``native`` (C, compiled on first use with gcc; see
    training/deployment/engine/README.md), ``torch`` (torch ops), or ``auto`` (native where it builds, else torch)."""
    max_tools: int = 128
    """Most entries a request's ``tools`` list may have (the server answers 400 naming ``tools`` and this limit)."""
    max_tools_bytes: int = 1024 * 1024
    """Most bytes a request's ``tools`` may take as compact JSON (400 naming ``tools`` and this limit above it)."""
    tool_call_parser: str = "auto"
    """How the server reads tool calls in chat replies: a parser of ``training/openai_api/tool_parsers`` (``hermes``
    / ``qwen``, ``llama3_json``, ``mistral``, ``qwen3_coder``, ``gemma``, ``functiongemma``, ``json``), or ``auto``:
    the one family the chat template writes, else ``hermes``; the choice and why is logged at start-up. Embedded
    engine only."""

    def __post_init__(self):
        _check(
            self.model is None or (isinstance(self.model, str) and self.model != ""),
            "model",
            "must be a folder or hub id (or None inside a DeployConfig)",
        )
        _check_device("device", self.device)
        _check(self.dtype in DTYPES, "dtype", f"{self.dtype!r} is not one of {DTYPES}")
        _check(self.max_batch_size > 0, "max_batch_size", f"must be > 0, got {self.max_batch_size}")
        _check(self.max_model_len > 1, "max_model_len", f"must be > 1, got {self.max_model_len}")
        _check(self.max_tools > 0, "max_tools", f"must be > 0, got {self.max_tools}")
        _check(self.max_tools_bytes > 0, "max_tools_bytes", f"must be > 0, got {self.max_tools_bytes}")
        _check(
            self.tool_call_parser in TOOL_CALL_PARSERS,
            "tool_call_parser",
            f"{self.tool_call_parser!r} is not one of {TOOL_CALL_PARSERS}",
        )
        _check_threads(self.num_threads)
        _check(
            all(isinstance(b, int) and b > 0 for b in self.cuda_graph_batch_sizes),
            "cuda_graph_batch_sizes",
            f"must be positive integers, got {self.cuda_graph_batch_sizes!r}",
        )
        _check(self.max_prefill_tokens > 0, "max_prefill_tokens", f"must be > 0, got {self.max_prefill_tokens}")
        _check(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            "kv_cache_memory_bytes",
            f"must be > 0 or None, got {self.kv_cache_memory_bytes}",
        )
        _check(
            0 < self.kv_cache_memory_fraction <= 1,
            "kv_cache_memory_fraction",
            f"must be in (0, 1], got {self.kv_cache_memory_fraction}",
        )
        _check(
            self.kv_block_size > 0 and self.kv_block_size % 16 == 0,
            "kv_block_size",
            f"must be a positive multiple of 16, got {self.kv_block_size}",
        )
        _check(self.max_waiting > 0, "max_waiting", f"must be > 0, got {self.max_waiting}")
        _check(
            self.inflight_update_kv in INFLIGHT_UPDATE_KV,
            "inflight_update_kv",
            f"{self.inflight_update_kv!r} is not one of {INFLIGHT_UPDATE_KV}",
        )
        _check(
            self.decode_kernel in DECODE_KERNELS,
            "decode_kernel",
            f"{self.decode_kernel!r} is not one of {DECODE_KERNELS}",
        )
        self.cuda_graph_batch_sizes = tuple(sorted(set(self.cuda_graph_batch_sizes)))

    def resolve_device(self):
        """The torch device ``device`` names (``auto`` → cuda if available)."""
        return resolve_device(self.device)

    def resolve_dtype(self, device):
        """The torch dtype ``dtype`` names (``auto`` → bfloat16 on CUDA, float32 on CPU)."""
        return resolve_dtype(self.dtype, device)


@dataclass
class DeployConfig:
    """The inference deployment the rollouts sample from.

    With ``base_url=None`` (the default) the recipe starts the embedded server as a child
    process on 127.0.0.1 and stops it at exit; with a URL it talks to that server instead.
    ``engine`` chooses the server: the embedded one, vLLM or SGLang (launched the same way, or
    attached by URL); see training/deployment/README.md, "vLLM and SGLang".
    """

    base_url: Optional[Union[str, list[str]]] = None
    """URL of an external OpenAI-compatible server (``http://host:port``), or a list of replicas; None = embedded."""
    num_replicas: int = 1
    """Embedded servers to start (each its own process and port); requests are balanced with session affinity."""
    host: str = "127.0.0.1"
    """Interface the embedded server binds to."""
    port: int = 0
    """Port of the embedded server; 0 picks a free one."""
    api_key: Optional[str] = None
    """Bearer token the server requires (and the sampler sends); None = no auth."""
    deployment_id: Optional[str] = None
    """Name of the served model: the embedded (and a launched vLLM) server serves under it, the sampler sends it as
    ``model`` and the log shows it. None = the base model's name (the sampler sends no ``model``)."""
    tokenizer_model: Optional[str] = None
    """Tokenizer the recipe gives ``make_rollout_fn`` (client-side chat templates and prompt tokens): a hub id or
    a folder, as ``base_model``; None = the base model's own. Checked at start: its ids must fit the model's
    vocabulary."""
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    """Settings of the inference engine (KV cache size, context length, device, dtype...): the embedded
    server receives them whole; vLLM / SGLang are launched with device, dtype, max_batch_size, max_model_len and seed,
    and refuse any other field set away from its default (training/utils/backends.py: ``engine_config_fields``)."""
    weight_sync: str = "auto"
    """How new weights reach the server: ``shm`` (same host), ``disk`` (safetensors folder), ``auto`` (shm when
    embedded, disk when attached), ``distributed`` (tensor by tensor over a torch.distributed group, to servers
    attached by ``base_url`` on other hosts or started by the Ray launcher, training/launch/; see
    training/deployment/weights/distributed.py)."""
    weight_sync_master_addr: Optional[str] = None
    """With ``weight_sync="distributed"``: the trainer's address as the servers reach it (it hosts the group's store)."""
    weight_sync_master_port: int = 0
    """With ``weight_sync="distributed"``: the store's port; 0 picks a free one."""
    weight_sync_backend: str = "gloo"
    """With ``weight_sync="distributed"``: ``gloo`` (CPU tensors) or ``nccl`` (both ends on GPUs)."""
    weight_bucket_mb: float = 256.0
    """With ``weight_sync="distributed"``: tensors are flattened into buckets of up to this many MiB, one
    broadcast each (each end holds one bucket of staging memory); 0 sends tensor by tensor."""
    startup_timeout_s: float = 300.0
    """How long to wait for the server's /health after start."""
    request_timeout_s: float = 600.0
    """Timeout of one sampling request."""
    max_retries: int = 4
    """Retries of a sampling request that found no server or got a 5xx (exponential backoff)."""
    retry_backoff_s: float = 0.5
    """First backoff of those retries; it doubles with each attempt."""
    max_restarts: int = 3
    """How many times the launcher restarts an embedded server that died."""
    log_file: Optional[str] = None
    """Where the embedded server's log goes; default ``<log_path>/deployment.log``."""
    engine: str = "auto"
    """Inference engine, a name of ``BACKENDS`` (training/utils/backends.py: what each one reads and can do):
    ``embedded`` (this package's server), ``vllm`` or ``sglang``; ``auto`` (the default) is vLLM when the replicas run
    on GPUs and a vLLM is installed that takes this config, else the embedded engine, decided and logged in one line
    at the run's start (training/utils/engine_choice.py); on the CPU it is always the embedded engine. With
    ``base_url`` set, ``vllm`` / ``sglang`` attach to that server (weight sync through the engine's own endpoints)."""
    engine_python: Optional[str] = None
    """Python that launches a ``vllm`` / ``sglang`` server; None = ``.venv-vllm/bin/python`` of this
    repository for vLLM when it exists (``scripts/setup_vllm.sh``), else the current interpreter."""
    engine_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for a launched ``vllm`` / ``sglang`` server."""
    engine_env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for a launched server, any engine (e.g. ``VLLM_CPU_KVCACHE_SPACE``); set last."""
    replica_devices: list[str] = field(default_factory=list)
    """Where launched replicas run: ``cpu``, ``cuda:N`` or ``cuda:N,M`` (several GPUs: vLLM / SGLang tensor
    parallel); replica ``i`` takes entry ``i % len``. Empty: the GPUs the trainer does not use, else
    ``engine_config.device``. Each server sees only its own GPUs (``CUDA_VISIBLE_DEVICES``); see
    training/deployment/placement.py."""
    colocate: bool = False
    """Let a replica share a GPU with the trainer (or the reference model). False refuses such a placement at start:
    both would compete for that GPU's memory. True also makes the recipes run the colocated lifecycle around every
    training step (the replicas sleep at ``sleep_level``, the trainer trains, the weights are pushed, the replicas
    wake) and train synchronously: generation and training cannot overlap on one GPU, so ``synchronous_training``
    left unset means True and ``synchronous_training=False`` is an error."""
    sleep_level: int = 1
    """With ``colocate``: what a replica frees while the trainer trains (``POST /sleep?level=N``): 1 its KV cache
    (and the weight copies derived for speed), 2 its weights too (the push that follows refills them)."""
    gpu_memory_fraction: Optional[float] = None
    """Share of a GPU's memory one vLLM / SGLang replica may take (vLLM ``--gpu-memory-utilization``: weights,
    activations and KV cache; SGLang ``--mem-fraction-static``: weights and KV pool); None = the engine's default
    (vLLM 0.9, SGLang 0.88). The embedded engine sizes its KV pool by ``engine_config.kv_cache_memory_bytes`` /
    ``kv_cache_memory_fraction`` instead and refuses this setting (training/utils/backends.py). Replicas sharing a
    GPU must fit: their fractions may not sum over 1."""

    def __post_init__(self):
        facts = backend(self.engine)
        for name in ("deployment_id", "tokenizer_model"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, str) and value.strip() != ""),
                name,
                f"must be a non-empty string or None, got {value!r}",
            )
        _check(
            isinstance(self.engine_args, (list, tuple)) and all(isinstance(a, str) for a in self.engine_args),
            "engine_args",
            f"must be a list of strings, got {self.engine_args!r}",
        )
        _check(
            isinstance(self.engine_env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in self.engine_env.items()),
            "engine_env",
            f"must map strings to strings, got {self.engine_env!r}",
        )
        _check(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        _check(
            isinstance(self.engine_config, EngineConfig),
            "engine_config",
            f"must be an EngineConfig, got {type(self.engine_config).__name__}",
        )
        _check(
            self.weight_sync in WEIGHT_SYNC_MODES,
            "weight_sync",
            f"{self.weight_sync!r} is not one of {WEIGHT_SYNC_MODES}",
        )
        _check(
            self.weight_sync_backend in ("gloo", "nccl"),
            "weight_sync_backend",
            f"{self.weight_sync_backend!r} is not one of ('gloo', 'nccl')",
        )
        _check(
            isinstance(self.weight_bucket_mb, (int, float)) and self.weight_bucket_mb >= 0,
            "weight_bucket_mb",
            f"must be a number >= 0, got {self.weight_bucket_mb!r}",
        )
        _check(
            0 <= self.weight_sync_master_port < 65536,
            "weight_sync_master_port",
            f"must be in [0, 65535], got {self.weight_sync_master_port}",
        )
        if self.weight_sync == "distributed":
            _check(
                facts.distributed_weights,
                "weight_sync",
                "'distributed' needs servers whose backend takes a distributed push (the embedded engine, or vLLM "
                "started with the worker extension; SGLang syncs through its own endpoints), attached by base_url or "
                "started by the Ray launcher (training/launch/); same-host launched servers use shm",
            )
            _check(
                bool(self.weight_sync_master_addr),
                "weight_sync_master_addr",
                "required with weight_sync='distributed': the trainer's address as the servers reach it",
            )
        _check(self.startup_timeout_s > 0, "startup_timeout_s", "must be > 0")
        _check(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        _check(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        _check(self.max_retries >= 0, "max_retries", f"must be >= 0, got {self.max_retries}")
        _check(self.retry_backoff_s >= 0, "retry_backoff_s", f"must be >= 0, got {self.retry_backoff_s}")
        _check(self.num_replicas >= 1, "num_replicas", f"must be >= 1, got {self.num_replicas}")
        _check(
            isinstance(self.replica_devices, (list, tuple))
            and all(isinstance(d, str) and _is_replica_device(d) for d in self.replica_devices),
            "replica_devices",
            f"must be a list of 'cpu', 'cuda:N' or 'cuda:N,M,...', got {self.replica_devices!r}",
        )
        _check(self.sleep_level in (1, 2), "sleep_level", f"must be 1 or 2, got {self.sleep_level!r}")
        _check(
            self.gpu_memory_fraction is None or 0 < self.gpu_memory_fraction <= 1,
            "gpu_memory_fraction",
            f"must be in (0, 1] or None, got {self.gpu_memory_fraction!r}",
        )
        if self.base_url is not None:
            urls = [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)
            _check(len(urls) > 0, "base_url", "an empty list; give at least one URL or None")
            for url in urls:
                _check(
                    isinstance(url, str) and url.startswith(("http://", "https://")),
                    "base_url",
                    f"must start with http:// or https://, got {url!r}",
                )
        check_backend(self, facts)


def check_backend(cfg: DeployConfig, facts: Backend) -> None:
    """Refuse what backend ``facts`` cannot do or does not read (training/utils/backends.py), naming the setting:
    ``colocate`` on a backend that cannot sleep, a ``sleep_level`` it lacks, ``gpu_memory_fraction`` where it
    does not size the memory, an ``engine_config`` field it does not read set away from its default."""
    name = f"the {facts.name} backend"
    if cfg.engine == "auto":  # checked as the engine it is without a GPU (training/utils/engine_choice.py)
        name = f"engine 'auto' (checked as the {facts.name} backend; set deployment.engine to choose another)"
    if cfg.colocate:
        _check(
            bool(facts.sleep_levels),
            "colocate",
            f"{name} cannot give its GPU memory back while the trainer trains (no sleep calls are wired for it); "
            "give its replicas GPUs of their own (colocate=False, replica_devices)",
        )
        _check(
            cfg.sleep_level in facts.sleep_levels,
            "sleep_level",
            f"{name} sleeps at levels {facts.sleep_levels}, got {cfg.sleep_level}",
        )
    memory = f"its memory is sized by {' / '.join(facts.memory_settings)}"
    _check(
        cfg.gpu_memory_fraction is None or "gpu_memory_fraction" in facts.memory_settings,
        "gpu_memory_fraction",
        f"{name} does not read it: {memory}",
    )
    for f in fields(EngineConfig):
        default = f.default if f.default is not MISSING else f.default_factory()
        value = getattr(cfg.engine_config, f.name)
        _check(
            facts.reads(f.name) or value == default,
            f"engine_config.{f.name}",
            f"{name} does not read it (it reads engine_config's {', '.join(sorted(facts.engine_config_fields or ()))}; "
            f"{memory}); leave it at its default {default!r}, got {value!r}",
        )


@dataclass
class WandBConfig:
    """Weights & Biases logging; off unless a project is set (``project`` or ``WANDB_PROJECT``).

    The ``WANDB_*`` environment wins over these fields, field by field: ``WANDB_PROJECT``, ``WANDB_ENTITY``,
    ``WANDB_NAME`` and ``WANDB_MODE`` replace ``project``, ``entity``, ``run_name`` and ``mode`` (the config
    holds a run's defaults, the environment is this invocation's choice). ``WANDB_PROJECT`` alone turns wandb
    on; ``WANDB_MODE=disabled`` turns it off. ``mode='offline'`` needs no network. A run checks that wandb is
    installed before anything loads (``training/utils/metrics.py``: ``check_trackers``).
    """

    project: Optional[str] = None
    """wandb project; None (and no ``WANDB_PROJECT``) disables wandb."""
    entity: Optional[str] = None
    """wandb entity (team or user); ``WANDB_ENTITY`` wins."""
    run_name: Optional[str] = None
    """Run name; default: the log folder's name; ``WANDB_NAME`` wins."""
    mode: str = "online"
    """``online``, ``offline`` or ``disabled``; ``WANDB_MODE`` in the environment wins."""
    tags: list[str] = field(default_factory=list)
    """Tags attached to the run."""

    def __post_init__(self):
        _check(
            self.mode in ("online", "offline", "disabled"),
            "mode",
            f"{self.mode!r} is not one of ('online', 'offline', 'disabled')",
        )

    @property
    def enabled(self) -> bool:
        """A project is set (``project`` or ``WANDB_PROJECT``) and neither ``WANDB_MODE`` nor ``mode`` is ``disabled``."""
        return self.project_source is not None and (os.environ.get("WANDB_MODE") or self.mode) != "disabled"

    @property
    def project_source(self) -> Optional[str]:
        """What sets the project, as a user would write it: ``WANDB_PROJECT`` or ``wandb.project``; None if neither."""
        if os.environ.get("WANDB_PROJECT"):
            return "WANDB_PROJECT"
        return "wandb.project" if self.project is not None else None


@dataclass
class TensorBoardConfig:
    """TensorBoard event files: every numeric metric of ``metrics.jsonl``, under its name, at its step.

    Needs the ``tensorboard`` package (``pip install -e '.[tensorboard]'``), checked before anything loads.
    View with ``tensorboard --logdir <log_path>/tensorboard``.
    """

    enabled: bool = False
    """Write TensorBoard scalars (``torch.utils.tensorboard.SummaryWriter``) beside ``metrics.jsonl``."""
    log_dir: Optional[str] = None
    """Folder of the event files; default ``<log_path>/tensorboard``."""

    def __post_init__(self):
        _check(isinstance(self.enabled, bool), "enabled", f"must be true or false, got {self.enabled!r}")
        _check(
            self.log_dir is None or (isinstance(self.log_dir, str) and self.log_dir.strip() != ""),
            "log_dir",
            f"must be a folder or None (<log_path>/tensorboard), got {self.log_dir!r}",
        )


@dataclass
class ProxyConfig:
    """The deadlines of the recording proxy a proxy rollout function starts (``training/proxy``): no agent can stall
    another or a weight sync beyond them."""

    stream_write_timeout_s: float = 30.0
    """How long one streamed write may wait for the agent to take the bytes; past it the stream is aborted and that
    episode fails (``rollout/failed/call_aborted``)."""
    drain_timeout_s: float = 60.0
    """How long the pre-sync drain waits for the calls in flight; past it the stragglers are cancelled, their
    episodes fail and the sync proceeds (counted per step in ``rollout/drain_cancelled_calls``)."""

    def __post_init__(self):
        for name in ("stream_write_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
                name,
                f"must be a number of seconds > 0, got {value!r}",
            )
