"""The policy trainer (one process, or sharded with FSDP2 under ``torchrun``) and the frozen reference model.

A training step, as the recipe drives it::

    old = trainer.logprobs(sequences)                       # l_old, no gradient
    for each PPO mini-batch:
        metrics = trainer.forward_backward(batch, loss_fn)  # gradients accumulate over micro-batches
        stats = trainer.optim_step()                        # clip, AdamW step, zero grads
    for name, tensor in trainer.named_weights(): ...        # weight sync to the deployment

``loss_fn(packed, logprobs_N) -> (loss, metrics)`` sees one packed micro-batch at a time and
divides by step-wide denominators itself (e.g. the number of trainable tokens of the whole
step), so that summing the micro-batch gradients gives the step's gradient.

Under ``torchrun`` (see ``distributed.py``) both models are sharded with FSDP2 and every
method is a collective that all ranks call with the SAME arguments (rank 0 leads, the others
follow). Each rank runs a token-balanced share of the sequences; the gradient is the SUM
over ranks (FSDP's divide factor is 1), so for the loss ``L = sum_mb loss_fn(mb)`` with
step-wide denominators, ``grad = sum_ranks sum_(mb of rank) d loss_fn(mb) / d theta``: the
same gradient as one process on the same batch (up to float summation order).
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from training.trainer import distributed as fsdp
from training.trainer import lora
from training.trainer.distributed import fsdp_logprobs, full_tensor, plan_micro_batches
from training.utils import dist as dist_utils
from training.utils.dist import Command, lead
from training.trainer.logprobs import score_sequences
from training.trainer.lr_schedule import SCHEDULE_STEP, LrSchedule
from training.trainer.model import decoder_layers, load_causal_lm, prefix_sharing_supported
from training.trainer.sharded_load import load_sharded
from training.trainer.packing import pack_sequences
from training.trainer.optimizer_offload import move_optimizer_state
from training.trainer.value_head import ValueHead, capture_hidden_states
from training.utils.config import TrainerConfig
from training.utils.device import resolve_device, resolve_dtype

logger = logging.getLogger(__name__)

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
"""``loss_fn(packed, logprobs_N) -> (scalar loss, metrics)`` for one micro-batch; with ``with_values`` (a critic
attached) ``loss_fn(packed, logprobs_N, values_N)``."""

_TOKENIZER_KWARGS = ("gguf_file", "revision", "trust_remote_code", "cache_dir", "local_files_only")


def _check_sequences(sequences: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Reject empty sequences and token ids outside ``[0, vocab_size)`` before they reach the model."""
    if len(sequences) == 0:
        raise ValueError("sequences: empty list")
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequences[{i}]: empty sequence")
        low, high = min(seq), max(seq)
        if low < 0 or high >= vocab_size:
            raise ValueError(f"sequences[{i}]: token id {low if low < 0 else high} outside [0, {vocab_size})")


def _vocab_size(model: torch.nn.Module) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


def combine_metrics(per_micro_batch: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Merge micro-batch metrics: keys ending ``_max`` → max, ``_min`` → min, others → mean
    weighted by each micro-batch's token count."""
    combined: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, num_tokens in per_micro_batch:
        for key, value in metrics.items():
            value = float(value)
            if key.endswith("_max"):
                combined[key] = max(combined.get(key, -math.inf), value)
            elif key.endswith("_min"):
                combined[key] = min(combined.get(key, math.inf), value)
            else:
                combined[key] = combined.get(key, 0.0) + value * num_tokens
                weights[key] = weights.get(key, 0.0) + num_tokens
    for key, total_weight in weights.items():
        combined[key] = combined[key] / total_weight if total_weight > 0 else 0.0
    return combined


def _export_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``transformers``' save steps: drop keys ignored on save, one name per tied tensor, undo renames."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state_dict.pop(key, None)
    state_dict = remove_tied_weights_from_state_dict(state_dict, model)
    return revert_weight_conversion(model, state_dict)


def use_fused_adamw(optimizer: torch.optim.Optimizer) -> None:
    """Select torch's fused AdamW kernel (CPU and CUDA; on CPU a fifth of the default per-tensor loop's time on
    SmolLM2).

    The kernel is a flag in each parameter group, and loading an optimizer state (a checkpoint written
    before this choice, say) restores the writer's flags; the moments are the same for every kernel, and
    the step count only has to sit where the fused kernel reads it (fp32, on the parameter's device; the
    per-tensor loop keeps it on the CPU). So the trainer sets the flag again before each step.
    """
    for group in optimizer.param_groups:
        if group.get("fused"):
            continue
        group["fused"], group["foreach"] = True, None
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor):
                optimizer.state[param]["step"] = step.to(device=param.device, dtype=torch.float32)


def _dtypes(cfg: TrainerConfig, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(parameter dtype, compute dtype): parameters default to float32 master weights, compute
    to bfloat16 autocast on CUDA."""
    param = torch.float32 if cfg.dtype == "auto" else resolve_dtype(cfg.dtype, device)
    return param, resolve_dtype(cfg.compute_dtype, device)


class _ScoringModel:
    """What the policy and the reference share: a loaded model and ``logprobs``."""

    cfg: TrainerConfig
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    compute_dtype: torch.dtype
    share_prefixes: bool = False
    """Shared-prompt packing in effect: ``cfg.shared_prompt_packing`` and exact for this model."""

    def _use_prefix_sharing(self) -> bool:
        """``cfg.shared_prompt_packing`` where ``prefix_sharing_supported``; the reason is logged when it falls back."""
        if not self.cfg.shared_prompt_packing:
            return False
        supported, reason = prefix_sharing_supported(self.model)
        if not supported:
            logger.info("shared-prompt packing off (ordinary packing instead): %s", reason)
        return supported

    thread_budget: Optional[Callable[[], int]] = None
    """Set by ``share_cpu``: how many CPU threads torch may use right now (wins over ``cfg.num_threads``)."""
    _budget_hooked = False

    def use_cpu_threads(self) -> None:
        """On CPU, set the calling thread's torch thread count (OpenMP settings are per thread, so every entry point
        calls this) to ``thread_budget()`` when set, else ``cfg.num_threads``; None leaves torch's setting alone."""
        if self.device.type != "cpu":
            return
        n = self.thread_budget() if self.thread_budget is not None else self.cfg.num_threads
        if n is not None and torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def share_cpu(self, budget: Callable[[], int]) -> None:
        """On CPU, ask ``budget()`` for the thread count before every decoder layer's forward and backward pass.

        For a server that generates on the same cores at times: while it does, ``budget`` returns the trainer's
        share, otherwise every core. Asking per layer lets a long step take the cores back as soon as they are free.
        """
        self.thread_budget = budget
        if self.device.type != "cpu" or self._budget_hooked:
            return
        self._budget_hooked = True

        def before_forward(module, args) -> None:
            self.use_cpu_threads()

        def before_backward(grad: torch.Tensor) -> None:
            self.use_cpu_threads()

        def after_forward(module, args, output) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(before_backward)  # runs when the gradient reaches this layer's output

        for layer in decoder_layers(self.model):
            layer.register_forward_pre_hook(before_forward)
            layer.register_forward_hook(after_forward)

    def autocast(self):
        """Autocast to ``compute_dtype`` when it differs from the parameter dtype, else a no-op."""
        if self.compute_dtype == self.dtype:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def logprobs(self, sequences: Sequence[Sequence[int]], temperature: float = 1.0) -> list[list[float]]:
        """Per-token logprobs of each sequence (no gradient, eval mode), packed by
        ``cfg.micro_batch_tokens``; ``result[i][t] = log p(seq[t] | seq[:t])``, ``result[i][0] = 0.0``."""
        _check_sequences(sequences, _vocab_size(self.model))
        self.use_cpu_threads()
        self.model.eval()
        if not dist_utils.is_distributed():
            with self.autocast():
                return score_sequences(
                    self.model,
                    sequences,
                    self.device,
                    self.cfg.micro_batch_tokens,
                    self.cfg.logprob_chunk_tokens,
                    temperature,
                    self.share_prefixes,
                )
        return self._sharded_logprobs(sequences, temperature)

    @torch.no_grad()
    def _sharded_logprobs(self, sequences: Sequence[Sequence[int]], temperature: float) -> list[list[float]]:
        """Each rank scores its share into a flat ``[sum of lengths]`` buffer, zeros elsewhere; a
        sum over ranks gives every rank all the logprobs (exact: each value is added to zeros)."""
        starts = [0]
        for seq in sequences:
            starts.append(starts[-1] + len(seq))
        flat = torch.zeros(starts[-1], dtype=torch.float32)
        for packed, is_real in plan_micro_batches(sequences, self.cfg.micro_batch_tokens, self.share_prefixes):
            with self.autocast():
                logprobs_N = (
                    fsdp_logprobs(self.model, packed.to(self.device), self.cfg.logprob_chunk_tokens, temperature)
                    .float()
                    .cpu()
                )
            if is_real:
                for i, logprobs_T in zip(packed.sample_indices, packed.split(logprobs_N)):
                    flat[starts[i] : starts[i + 1]] = logprobs_T
        dist_utils.all_reduce_sum_(flat)
        return [flat[starts[i] : starts[i + 1]].tolist() for i in range(len(sequences))]


class ReferenceModel(_ScoringModel):
    """A frozen copy of the starting policy (for the KL penalty), on ``cfg.reference_device``.

    ``reference_device="auto"`` means the policy's device (``cfg.device``). No parameter
    requires grad; the model stays in eval mode.
    """

    def __init__(self, model_path: str, cfg: TrainerConfig, **load_kwargs: Any):
        self.cfg = cfg
        self.device = resolve_device(cfg.device if cfg.reference_device == "auto" else cfg.reference_device)
        self.dtype = self.compute_dtype = _dtypes(cfg, self.device)[1]  # frozen: no master copy needed
        self.device = dist_utils.device_for_rank(self.device)
        if dist_utils.is_distributed():  # each rank reads its own shards (sharded_load.py)
            self.model = load_sharded(model_path, self.device, self.dtype, **load_kwargs)
        else:
            self.model = load_causal_lm(model_path, self.device, self.dtype, **load_kwargs)
        self.model.requires_grad_(False)
        self.model.eval()
        self.share_prefixes = self._use_prefix_sharing()

    @torch.no_grad()
    def refresh_from(self, policy: "PolicyTrainer") -> None:
        """Become a copy of ``policy``'s current weights (``LossConfig.reference_refresh_interval``), in this model's
        dtype, parameter by parameter (under FSDP2 each rank copies its own shards: both are sharded alike)."""
        if policy.lora:
            raise ValueError(
                "refresh_from: with LoRA the reference is the policy's own base weights (no copy to refresh)"
            )
        mine, theirs = dict(self.model.named_parameters()), dict(policy.model.named_parameters())
        if mine.keys() != theirs.keys():
            raise ValueError(
                f"refresh_from: the reference and the policy differ in parameters: {sorted(mine.keys() ^ theirs.keys())[:3]}"
            )
        for name, param in mine.items():
            param.copy_(theirs[name])


class PolicyTrainer(_ScoringModel):
    """The trainable policy: model, AdamW optimizer, tokenizer.

    Shares ``logprobs`` with ``ReferenceModel``; adds gradients, the optimizer,
    weight export and saving. Weight decay applies to matrices (``ndim >= 2``) only, not to
    norms and biases. With ``cfg.lora_rank > 0`` only LoRA adapters train (``lora.py``); what
    leaves the trainer (``named_weights``, ``save_pretrained``) is merged into the base weights.
    """

    def __init__(self, model_path: str, cfg: TrainerConfig, total_steps: Optional[int] = None, **load_kwargs: Any):
        """``total_steps``: the optimizer steps of the whole run, where ``cfg.lr_schedule`` decays (``lr_schedule.py``)."""
        from transformers import AutoTokenizer

        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.schedule = LrSchedule(cfg, total_steps)
        self.device = dist_utils.device_for_rank(resolve_device(cfg.device))
        self.dtype, self.compute_dtype = _dtypes(cfg, self.device)
        self.model_path = model_path
        self.lora = cfg.lora_rank > 0
        """LoRA adapters train, the base weights are frozen (``lora.py``)."""
        checkpointing = bool(cfg.gradient_checkpointing)  # None (the recipe's plan did not decide): off
        if dist_utils.is_distributed() and not self.lora:  # each rank reads its own shards (sharded_load.py)
            self.model = load_sharded(
                model_path, self.device, self.dtype, checkpointing, self.compute_dtype, **load_kwargs
            )
        else:
            # LoRA: the frozen base needs no fp32 master copy, so it is held in the compute dtype (bf16 on CUDA) unless
            # trainer.dtype is set; the adapters train in self.dtype (apply_lora)
            base_dtype = self.compute_dtype if self.lora and cfg.dtype == "auto" else self.dtype
            self.model = load_causal_lm(model_path, self.device, base_dtype, checkpointing, **load_kwargs)
        self.model.eval()
        if self.lora:
            trainable = lora.apply_lora(self.model, cfg, self.dtype)
            logger.info("LoRA rank %d: %d trainable parameters", cfg.lora_rank, trainable)
        self.share_prefixes = self._use_prefix_sharing()
        if dist_utils.is_distributed() and self.lora:  # before the optimizer: it must hold the sharded parameters
            fsdp.shard_model(self.model, self.device, self.compute_dtype)
        tokenizer_kwargs = {k: v for k, v in load_kwargs.items() if k in _TOKENIZER_KWARGS}
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, **tokenizer_kwargs)
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=self.schedule.lr(0), betas=tuple(cfg.adam_betas), fused=True
        )
        for group in self.optimizer.param_groups:  # saved with the optimizer state, so a resume continues the schedule
            group[SCHEDULE_STEP] = 0
        self.critic: Optional[ValueHead] = None
        """The value head of ``advantage="gae"`` (``attach_critic``); None otherwise."""

    def attach_critic(self, critic_cfg) -> ValueHead:
        """Give the policy a value head (``value_head.py``, ``critic_cfg`` a ``CriticConfig``) trained beside it; one
        process only."""
        if dist_utils.is_distributed():
            raise NotImplementedError("advantage='gae': the critic runs in one process only, not under torchrun yet")
        hidden = int(self.model.config.get_text_config().hidden_size)
        self.critic = ValueHead(
            hidden, critic_cfg, self.device, betas=tuple(self.cfg.adam_betas), grad_clip_norm=self.cfg.grad_clip_norm
        )
        return self.critic

    @torch.no_grad()
    def logprobs_and_values(
        self, sequences: Sequence[Sequence[int]], temperature: float = 1.0
    ) -> tuple[list[list[float]], list[list[float]]]:
        """``logprobs`` and the critic's values (aligned alike, ``value_head.py``) of each sequence from one
        no-grad forward per micro-batch; needs ``attach_critic``."""
        if self.critic is None:
            raise ValueError("logprobs_and_values: no critic attached (attach_critic)")
        _check_sequences(sequences, _vocab_size(self.model))
        self.use_cpu_threads()
        self.model.eval()
        logprobs: list[list[float]] = [[] for _ in sequences]
        values: list[list[float]] = [[] for _ in sequences]
        for packed in pack_sequences(sequences, self.cfg.micro_batch_tokens, self.share_prefixes):
            packed = packed.to(self.device)
            with capture_hidden_states(self.model) as hidden, self.autocast():
                logprobs_N = fsdp_logprobs(self.model, packed, self.cfg.logprob_chunk_tokens, temperature)
            values_N = self.critic.values_N(hidden[0], packed)
            for i, lp_T, v_T in zip(
                packed.sample_indices, packed.split(logprobs_N.cpu()), packed.split(values_N.cpu())
            ):
                logprobs[i], values[i] = lp_T.tolist(), v_T.tolist()
        return logprobs, values

    def forward_backward(
        self, sequences: Sequence[Sequence[int]], loss_fn: LossFn, temperature: float = 1.0, with_values: bool = False
    ) -> dict[str, float]:
        """Pack ``sequences``, and per micro-batch: logprobs with gradient, ``loss_fn``, backward.

        Gradients accumulate in ``.grad`` until ``optim_step``. Returns the micro-batch metrics
        combined by ``combine_metrics`` plus ``loss``, the sum of the micro-batch losses. Under
        torchrun each rank packs its share of ``sequences`` (``packed.sample_indices`` still index
        the full list, so ``loss_fn`` is unchanged), padding micro-batches contribute
        ``0 * sum(logprobs)``, and the metrics are combined over ranks the same way. ``with_values``: the critic's
        values of the same forward (``value_head.py``) are passed on, ``loss_fn(packed, logprobs_N, values_N)``.
        """
        _check_sequences(sequences, _vocab_size(self.model))
        if with_values and self.critic is None:
            raise ValueError("forward_backward: with_values needs a critic (attach_critic)")
        self.use_cpu_threads()
        self.model.train()
        per_micro_batch: list[tuple[dict[str, float], int]] = []
        total_loss = 0.0
        try:
            for packed, is_real in plan_micro_batches(sequences, self.cfg.micro_batch_tokens, self.share_prefixes):
                packed = packed.to(self.device)
                hooked = capture_hidden_states(self.model) if with_values else contextlib.nullcontext()
                with hooked as hidden, self.autocast():
                    logprobs_N = fsdp_logprobs(self.model, packed, self.cfg.logprob_chunk_tokens, temperature)
                if not is_real:  # keeps this rank in step with the others' forwards and backwards
                    (logprobs_N.sum() * 0.0).backward()
                    continue
                if with_values:
                    loss, metrics = loss_fn(packed, logprobs_N, self.critic.values_N(hidden[0], packed))
                else:
                    loss, metrics = loss_fn(packed, logprobs_N)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError("loss_fn: must return a scalar tensor as its first value")
                loss.backward()
                total_loss += float(loss.detach())
                per_micro_batch.append(({k: float(v) for k, v in metrics.items()}, packed.num_tokens))
        finally:
            self.model.eval()
        combined = combine_metrics(per_micro_batch)
        combined["loss"] = total_loss
        return dist_utils.reduce_metrics(combined, float(sum(n for _, n in per_micro_batch)), sum_keys=("loss",))

    def optim_step(self) -> dict[str, float]:
        """Clip the global grad norm to ``cfg.grad_clip_norm`` (0 = no clipping), step AdamW at the scheduled
        learning rate (``lr_schedule.py``), zero grads.

        Returns ``grad_norm`` (before clipping), ``learning_rate`` (this step's), and on CUDA
        ``gpu_memory_peak_gb`` (this process's peak allocated memory on its GPU so far). A non-finite grad
        norm skips the update (the grads are dropped) and is reported as is; the schedule counts the step anyway.
        With a critic its head steps too (its own optimizer and clipping: ``value_grad_norm``).
        """
        self.use_cpu_threads()
        lr = self.schedule.begin_step(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip_norm if self.cfg.grad_clip_norm > 0 else math.inf
        if params:  # under FSDP2 the grads are DTensor shards and the norm is a global one
            grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        else:
            grad_norm = 0.0
        offload = self.cfg.offload_optimizer and self.device.type == "cuda"
        if offload:  # the moments come back from host memory for the step
            move_optimizer_state(self.optimizer, self.device)
        if math.isfinite(grad_norm):
            use_fused_adamw(self.optimizer)
            self.optimizer.step()
        else:
            logger.warning("optim_step: non-finite grad norm %s, update skipped", grad_norm)
        if offload:
            move_optimizer_state(self.optimizer, torch.device("cpu"))
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.end_step(self.optimizer)
        out = {"grad_norm": grad_norm, "learning_rate": lr}
        if self.critic is not None:
            out["value_grad_norm"] = self.critic.step()
        if self.device.type == "cuda":
            out["gpu_memory_peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    @property
    def learning_rate(self) -> float:
        """The learning rate the next ``optim_step`` trains at."""
        return self.schedule.lr(self.schedule.step_of(self.optimizer))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's weights under the names ``save_pretrained`` writes to safetensors, detached.

        Uses the same steps as ``transformers``' ``save_pretrained``: drop keys ignored on save,
        keep one name per tied tensor (a tied ``lm_head`` is not emitted when the checkpoint does
        not store it), and undo load-time renames/conversions. Tensors are on the trainer's
        device and share storage with the live parameters where no conversion applies.

        With LoRA every adapted weight is yielded merged, ``W + s·BA`` (``lora.export_plan``),
        under the base model's name, and the adapters themselves are not: the result loads into
        a plain model of the base architecture.

        Under torchrun every rank must iterate it (rank 0 announces the pass to the others):
        each FSDP2 parameter is gathered whole (``full_tensor``) one at a time, so the extra
        memory is about one tensor; non-zero ranks discard what they get. A consumer that stops
        early still completes the gathers, keeping the ranks in step.
        """
        sharded = fsdp.is_sharded(self.model)
        if not sharded and not self.lora:
            for name, tensor in _export_state_dict(self.model, self.model.state_dict()).items():
                yield name, tensor.detach()
            return
        with lead(Command.WEIGHTS):
            state_dict = self.model.state_dict()
            plan = self._export_plan(state_dict)
            done = 0
            try:
                for name, key, merge, _, _ in plan:
                    whole = self._whole_weight(state_dict, key, merge)
                    done += 1
                    yield name, whole
            finally:
                if sharded:  # the consumer stopped early: finish the gathers in step
                    for _, key, merge, _, _ in plan[done:]:
                        self._whole_weight(state_dict, key, merge)

    @staticmethod
    def _whole_weight(state_dict: dict, key: str, merge: Optional[lora.LoraMerge]) -> torch.Tensor:
        """``state_dict[key]`` whole (gathered under FSDP2), merged with its adapter when ``merge`` says so."""
        whole = full_tensor(state_dict[key]).detach()
        if merge is not None:
            whole = lora.merged(
                whole,
                full_tensor(state_dict[merge.a_key]).detach(),
                full_tensor(state_dict[merge.b_key]).detach(),
                merge,
            )
        return whole

    def _export_plan(
        self, state_dict: dict
    ) -> list[tuple[str, str, Optional[lora.LoraMerge], torch.dtype, tuple[int, ...]]]:
        """(export name, state_dict key, LoRA merge or None, dtype, full shape) per tensor ``named_weights``
        yields, picked on shape-only stand-ins: the same answer on every rank, no collective."""
        meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state_dict.items()}
        sources = lora.export_plan(self.model, meta)  # without LoRA: every key as it is
        renamed = {name: meta[key] for name, (key, _) in sources.items()}
        origin = {id(v): name for name, v in renamed.items()}
        out = []
        for name, tensor in _export_state_dict(self.model, renamed).items():
            if origin.get(id(tensor)) is None:
                raise NotImplementedError(
                    f"named_weights: {name!r} is converted on save (e.g. fused experts); "
                    "not supported for FSDP-sharded or LoRA models yet"
                )
            key, merge = sources[origin[id(tensor)]]
            out.append((name, key, merge, tensor.dtype, tuple(tensor.shape)))
        return out

    def weight_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of each tensor ``named_weights()`` yields, in the same order,
        without gathering anything (a local call on every rank: no collective)."""
        if not fsdp.is_sharded(self.model) and not self.lora:
            return [(name, t.dtype, tuple(t.shape)) for name, t in self.named_weights()]
        return [(name, dtype, shape) for name, _, _, dtype, shape in self._export_plan(self.model.state_dict())]

    def save_pretrained(self, out_dir: Union[str, Path], adapters: Optional[bool] = None) -> Path:
        """Write model (safetensors) + tokenizer as a plain Hugging Face folder; returns its path.

        With LoRA the folder holds the merged weights (``named_weights``); ``adapters`` (default
        ``cfg.lora_save_adapters``) also writes the adapters alone into ``<out_dir>/adapter`` in
        ``peft``'s format. Under torchrun every rank calls it; the full weights are gathered to
        rank 0's CPU, which alone writes the folder.
        """
        out = Path(out_dir)
        main = dist_utils.is_main_rank()
        if not dist_utils.is_distributed() and not self.lora:
            out.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(out)
            self.tokenizer.save_pretrained(out)
            return out
        with lead(Command.EXPORT):
            state_dict = {name: tensor.cpu() for name, tensor in self.named_weights() if main}
            if main:
                out.mkdir(parents=True, exist_ok=True)
                self.model.save_pretrained(out, state_dict=state_dict)
                self.tokenizer.save_pretrained(out)
            if self.lora and (self.cfg.lora_save_adapters if adapters is None else adapters):
                model_state = self.model.state_dict()
                tensors = {
                    name: full_tensor(model_state[key]).detach().cpu()
                    for name, key in lora.adapter_state_dict(self.model, model_state).items()
                }
                if main:
                    lora.save_adapters(self.cfg, tensors, out / "adapter", base_model=self.model_path)
        return out

    def base_reference(self) -> "_ScoringModel":
        """The base model under this trainer's adapters (LoRA only): a KL reference that shares the
        policy's frozen weights instead of loading a second copy (``reference_device`` does not apply)."""
        if not self.lora:
            raise ValueError("base_reference: needs lora_rank > 0 (without LoRA load a ReferenceModel)")
        return _BaseModelReference(self)


class _BaseModelReference(_ScoringModel):
    """``logprobs`` of a LoRA policy's base model: the policy's own model with its adapters switched off."""

    def __init__(self, policy: PolicyTrainer):
        self.cfg, self.model, self.device = policy.cfg, policy.model, policy.device
        self.dtype, self.compute_dtype, self.share_prefixes = policy.dtype, policy.compute_dtype, policy.share_prefixes
        self.policy = policy

    @property
    def thread_budget(self) -> Optional[Callable[[], int]]:
        return self.policy.thread_budget

    def share_cpu(self, budget: Callable[[], int]) -> None:
        """The model is the policy's, so are its layer hooks and their budget."""
        self.policy.share_cpu(budget)

    def logprobs(self, sequences: Sequence[Sequence[int]], temperature: float = 1.0) -> list[list[float]]:
        with lora.adapters_disabled(self.model):
            return super().logprobs(sequences, temperature)
