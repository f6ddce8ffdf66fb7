"""Lean forward for Llama / Qwen2 / Qwen3 decoders over the paged KV cache (kv_cache.py).

Same weights as the transformers model, read from the folder's safetensors, stored fused:
``qkv = [q; k; v]`` and ``gate_up = [gate; up]`` so a layer is four matmuls (plus biases where
the checkpoint has them: Qwen2's qkv bias, Llama's ``attention_bias`` / ``mlp_bias``). Qwen3's
per-head ``q_norm`` / ``k_norm`` are applied before RoPE, as transformers does. RMSNorm,
RoPE (``rope_parameters`` / ``rope_theta``, transformers' init functions for scaled variants)
and attention (SDPA, GQA) follow the transformers definitions, so greedy outputs match token
for token and fp32 logprobs to ~1e-5.

Two entry points, both return fp32 logits; a sequence's K/V lives in the blocks of its block table:
- ``prefill(items)``: new tokens of several sequences packed into one ``[N, hidden]`` batch for
  the matmuls; per layer every item's K/V is written first, then each item attends (SDPA) over
  its blocks (cached prefix + new tokens). So an item may attend to blocks another item of the same
  batch writes (the scheduler shares a prefix admitted in the same step that way).
- ``decode(block_tables, tokens, positions)``: one token per running sequence; attention over the
  blocks of each row's table (gathered per layer), masked per row by its length, or, for rows
  that share prefix blocks (a GRPO group), ``SharedPrefixAttention``: the prefix read once.
On CUDA the decode step is replayed from CUDA graphs (cuda_graphs.py).

On CPU in fp32 and bf16 the decode step runs in C by default (``native``, chosen by build.py:
``NativeDecoder``, native.py), and in fp32 so do the prefill's norms, RoPE, K/V writes and SiLU gate
(``native_passes``); ``decode_forward`` below is the torch step (``decode_kernel="torch"``, fp16, CUDA,
or no C compiler).

Which kernel runs the matmuls outside the C step is part of the execution plan (``matmul_kernel``, recorded by
build.py's ``build_runner``; ``self.matmul``). With the fp32 native step, the prefill's five matmuls (qkv, o,
gate_up, down, LM head) run in C too, on its packed weights (``native.linear``): no other copy is made. Otherwise,
on CPU in fp32 (and in bf16 where the CPU has native bf16) the five matmuls of the torch step and of every prefill
run as oneDNN linears on weights reordered once into oneDNN's blocked layout (``weights_changed``, called after
every weight change). In fp32 they are 1.3–3.5× faster than ``F.linear`` (MKL, ~100 GFLOPS at 32 rows) at every
batch size on the AMD EPYC this was measured on. The reordered copies double the weights' memory. The fp32 sums
run in another order than MKL's, so logits move by ~1e-6 relative; the trainer-side exactness figure is in
BENCHMARKS.md ("exactness").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from training.deployment.engine.runners.attention import SharedPrefix, SharedPrefixAttention, decode_attention
from training.deployment.engine.kv_cache import KVBudget, KVCache, padded_tables
from training.deployment.engine.runners.native import MATMULS, NativeDecoder, silu_mul, unpack_weight
from training.deployment.engine.runners.native import linear as native_linear
from training.deployment.engine.runners.native import rms_norm as native_rms_norm
from training.deployment.engine.runners.sleep import FreedStorages, release_host_memory, trim_heap
from training.deployment.engine.weights import checkpoint_shapes, load_safetensors

log = logging.getLogger(__name__)

LEAN_MODEL_TYPES = ("llama", "qwen2", "qwen3")
LOGITS_CHUNK = 4096
"""Vocabulary rows of the LM head per matmul on CPU without oneDNN (a chunk of the head stays in cache)."""
PACK_BATCH = 32
"""Batch size oneDNN's weight reorder is tuned for (any batch size runs on the packed weights)."""
LOGITS_ROWS = 64
"""Rows the CPU logits buffer is first made for (it grows to the largest batch)."""


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN linears on reordered weights: CPU, a torch built with mkldnn, fp32 (or bf16 where the CPU has it)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


MATMUL_KERNELS = ("native", "onednn", "torch")
"""How a lean runner's matmuls outside the C decode step (the prefill's, scoring's, the torch step's) and its LM head
run: ``native`` (C, ``native.linear`` on the native step's packed panels), ``onednn`` (oneDNN linears on reordered
copies), ``torch`` (``F.linear``)."""


def matmul_kernel(native: bool, device: torch.device, dtype: torch.dtype) -> str:
    """The ``MATMUL_KERNELS`` entry of a runner whose decode step is ``native`` (C) or not: ``native`` with the fp32
    native step (its panels are the only copy of the weights), else ``onednn`` where it runs
    (``onednn_linear_available``), else ``torch``. ``build_runner`` records it in the execution plan."""
    if native and dtype == torch.float32:
        return "native"
    return "onednn" if onednn_linear_available(device, dtype) else "torch"


@dataclass
class PrefillItem:
    """New tokens of one sequence: ``token_ids`` go to positions ``start_pos ..`` of the blocks of ``block_table``
    (which covers every position up to the last new token)."""

    block_table: list[int]
    token_ids: list[int]
    start_pos: int

    def kv_slots(self, block_size: int) -> torch.Tensor:
        """Flat KV slot (block x block_size + offset) of each new token, int64 [n]."""
        pos = torch.arange(self.start_pos, self.start_pos + len(self.token_ids))
        return torch.tensor(self.block_table, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size


def lean_supported(config) -> str | None:
    """None if the lean forward can run this transformers config, else the reason it cannot."""
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {LEAN_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    return None


def _rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))


class LeanModelRunner:
    """Fused-weight decoder forward over a :class:`KVCache`; ``weight_shapes`` uses checkpoint names."""

    def __init__(
        self,
        path: str,
        config,
        budget: KVBudget,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        native: bool,
        matmul: Optional[str] = None,
    ):
        """``native``: run the decode step in C (``NativeDecoder``; raises NativeUnavailable where it cannot);
        ``matmul``: the ``MATMUL_KERNELS`` entry of the other matmuls (None: ``matmul_kernel``'s choice). The engine
        decides both once, in build.py (``build_runner``); this class has no default for ``native``."""
        reason = lean_supported(config)
        if reason:
            raise ValueError(f"lean forward cannot run this model: {reason}")
        allowed = matmul_kernel(native, device, dtype)
        if matmul is not None and matmul != allowed and not (matmul == "torch" and allowed == "onednn"):
            raise ValueError(
                f"matmul={matmul!r} cannot run with native={native} on {device} in {dtype} ({allowed!r} does)"
            )
        self.matmul = matmul or allowed
        """The ``MATMUL_KERNELS`` entry ``_linear``, ``_linear_add`` and ``logits`` dispatch on."""
        self.config, self.dtype, self.device = config, dtype, device
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.num_heads
        self.eps = config.rms_norm_eps
        self.vocab_size = config.vocab_size
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.weight_shapes = checkpoint_shapes(path)
        self.tied = self.tied and "lm_head.weight" not in self.weight_shapes
        self.native_linears = self.matmul == "native"
        """The prefill's (and scoring's) matmuls and LM head run in C on the native step's packed weights
        (``native.linear``, the decode step's own kernel): no third copy of the weights."""
        self.onednn = self.matmul == "onednn"
        """The matmuls run as oneDNN linears on reordered weights (``weights_changed`` makes them)."""
        self.lm_head_packed: torch.Tensor | None = None
        self._unheld = FreedStorages()
        """With ``native_linears``: the checkpoint-layout matmul weights, their memory given back between updates
        (nothing reads them: the packed panels are the live copy); ``begin_weight_write`` allocates them again."""
        self._allocate(self.weight_shapes)
        self.load_weights(load_safetensors(path))
        inv, scale = _rope_inv_freq(config, self.head_dim)
        pos = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin() * scale
        self.rope_fp32 = (
            (emb.cos() * scale).to(device=device),
            torch.cat([-sin[:, : self.head_dim // 2], sin[:, self.head_dim // 2 :]], -1).to(device=device),
        )
        """cos and signed sin [max_model_len, head_dim] in fp32 (the native step's, whatever the dtype)."""
        self.cos, self.sin_signed = (t.to(dtype=dtype) for t in self.rope_fp32)
        self.max_len = max_model_len
        self.cache = KVCache(self.num_layers, budget, self.num_kv_heads, self.head_dim, dtype, device)
        self._logits_buf: torch.Tensor | None = None
        self.graphs = None  # CudaGraphDecoder, set by the engine on CUDA
        self.native: Optional[NativeDecoder] = NativeDecoder(self) if native else None
        """The decode step in C (native.py), or None: torch ops (``decode_forward``)."""
        self.cache.zero_handed_out = self.native is None  # the C step reads only the positions a row wrote
        if self.native_linears:
            for i, L in enumerate(self.layers):
                for name in MATMULS:
                    L[name + "_native"] = self.native.packed[name][i]
            self._unheld.free(self._matmul_weights())
            release_host_memory(device)

    # ----------------------------------------------------------------- weights
    def _allocate(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Create the fused tensors and map each checkpoint name to the view it is copied into."""

        def new(*shape):
            return torch.empty(shape, dtype=self.dtype, device=self.device)

        qd, kd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.targets: dict[str, torch.Tensor] = {}
        self.embed = new(*shapes["model.embed_tokens.weight"])
        self.targets["model.embed_tokens.weight"] = self.embed
        self.final_norm = new(self.hidden)
        self.targets["model.norm.weight"] = self.final_norm
        if self.tied:
            self.lm_head = self.embed
        else:
            self.lm_head = new(*shapes["lm_head.weight"])
            self.targets["lm_head.weight"] = self.lm_head
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            inter = shapes[p + "mlp.gate_proj.weight"][0]
            L = {
                "qkv_w": new(qd + 2 * kd, self.hidden),
                "o_w": new(self.hidden, qd),
                "gate_up_w": new(2 * inter, self.hidden),
                "down_w": new(self.hidden, inter),
                "in_norm": new(self.hidden),
                "post_norm": new(self.hidden),
            }
            t = self.targets
            t[p + "self_attn.q_proj.weight"] = L["qkv_w"][:qd]
            t[p + "self_attn.k_proj.weight"] = L["qkv_w"][qd : qd + kd]
            t[p + "self_attn.v_proj.weight"] = L["qkv_w"][qd + kd :]
            t[p + "self_attn.o_proj.weight"] = L["o_w"]
            t[p + "mlp.gate_proj.weight"] = L["gate_up_w"][:inter]
            t[p + "mlp.up_proj.weight"] = L["gate_up_w"][inter:]
            t[p + "mlp.down_proj.weight"] = L["down_w"]
            t[p + "input_layernorm.weight"] = L["in_norm"]
            t[p + "post_attention_layernorm.weight"] = L["post_norm"]
            if p + "self_attn.q_proj.bias" in shapes:
                L["qkv_b"] = new(qd + 2 * kd)
                t[p + "self_attn.q_proj.bias"] = L["qkv_b"][:qd]
                t[p + "self_attn.k_proj.bias"] = L["qkv_b"][qd : qd + kd]
                t[p + "self_attn.v_proj.bias"] = L["qkv_b"][qd + kd :]
            if p + "self_attn.o_proj.bias" in shapes:
                L["o_b"] = new(self.hidden)
                t[p + "self_attn.o_proj.bias"] = L["o_b"]
            if p + "mlp.gate_proj.bias" in shapes:
                L["gate_up_b"] = new(2 * inter)
                t[p + "mlp.gate_proj.bias"] = L["gate_up_b"][:inter]
                t[p + "mlp.up_proj.bias"] = L["gate_up_b"][inter:]
                L["down_b"] = new(self.hidden)
                t[p + "mlp.down_proj.bias"] = L["down_b"]
            if p + "self_attn.q_norm.weight" in shapes:
                L["q_norm"], L["k_norm"] = new(self.head_dim), new(self.head_dim)
                t[p + "self_attn.q_norm.weight"] = L["q_norm"]
                t[p + "self_attn.k_norm.weight"] = L["k_norm"]
            self.layers.append(L)
        unknown = sorted(set(shapes) - set(self.targets))
        if unknown:
            raise ValueError(f"lean forward does not know checkpoint tensor {unknown[0]}")

    def _matmul_weights(self) -> list[torch.Tensor]:
        return [L[name + "_w"] for L in self.layers for name in MATMULS]

    @torch.inference_mode()
    def begin_weight_write(self) -> None:
        """Call before writing ``targets`` piece by piece (a streamed update): the checkpoint-layout matmul weights
        get their memory back, filled from the packed panels, so an update that stops early leaves the served
        weights as they were. A no-op unless ``native_linears`` (``load_weights`` needs no call)."""
        if not self._unheld.tensors:
            return
        self._unheld.restore()
        for name in MATMULS:
            for L, packed in zip(self.layers, self.native.packed[name]):
                w = L[name + "_w"]
                w.copy_(unpack_weight(packed, *w.shape))

    @torch.inference_mode()
    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a validated full set into the fused tensors in place (CUDA graphs stay valid).

        With the checkpoint-layout matmul weights unheld (``native_linears``), one layer's get memory at a time:
        written, packed into its panels, given back; a push then holds one layer more than the served weights
        (besides the update itself, which ``load_safetensors`` maps rather than copies), not a model more, and
        the freed heap pages go back to the system at the end (``trim_heap``)."""
        if not self._unheld.tensors:
            try:
                for name, target in self.targets.items():
                    target.copy_(tensors[name])
            finally:
                self.weights_changed()
            return
        for name, target in self.targets.items():
            if not name.startswith("model.layers."):
                target.copy_(tensors[name])
        for i, L in enumerate(self.layers):
            prefix, raw = f"model.layers.{i}.", [L[name + "_w"] for name in MATMULS]
            for w in raw:
                w.untyped_storage().resize_(w.nbytes)
            try:
                for name, target in self.targets.items():
                    if name.startswith(prefix):
                        target.copy_(tensors[name])
                self.native.pack_layer(i)
            finally:
                for w in raw:
                    w.untyped_storage().resize_(0)
        self.native.pack_head()
        trim_heap()  # not release_host_memory: its gc.collect() took 120-150 ms of every push

    def weights_changed(self) -> None:
        """Refresh what is derived from ``targets`` (the oneDNN and native copies); whoever writes ``targets`` calls it.
        While the runner sleeps (``sleeping``, sleep.py) nothing is derived: waking rebuilds the copies. With
        ``native_linears`` the packed panels are then the only copy of the matmul weights (``begin_weight_write``);
        when nothing was written since (a wake without an update), they are already current."""
        if getattr(self, "sleeping", False):
            return
        if getattr(self, "native", None) is not None and not self._unheld.tensors:
            self.native.pack_weights()
            if self.native_linears:
                self._unheld.free(self._matmul_weights())
                release_host_memory(self.device)
        if not self.onednn:
            return
        with torch.inference_mode():
            for L in self.layers:
                for name in MATMULS:
                    L[name + "_packed"] = torch.ops.mkldnn._reorder_linear_weight(L[name + "_w"], PACK_BATCH)
            self.lm_head_packed = torch.ops.mkldnn._reorder_linear_weight(self.lm_head, PACK_BATCH)

    # ----------------------------------------------------------------- forward pieces
    @property
    def native_passes(self) -> bool:
        """The norms, RoPE, K/V writes and SiLU gate of the prefill run in C too (the fp32 native step only)."""
        return self.native is not None and self.native.elementwise

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.native_passes and x.dim() == 2:
            return native_rms_norm(x, w, self.eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows for ``positions``, shaped [N, 1, d] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def _qk_rope(self, L: dict, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q and k heads of a fused projection, per-head norm (Qwen3), RoPE: [N, H + K, d], q heads first.

        Rotate-half RoPE as one roll: ``x·cos + rotate_half(x)·sin == x·cos + roll(x, d/2)·sin_signed``
        with ``sin_signed = [-sin_first_half, sin_second_half]``; q and k go through it together.
        """
        n, d = qkv.shape[0], self.head_dim
        qd, kd = self.num_heads * d, self.num_kv_heads * d
        if "q_norm" in L:
            q = self._norm(qkv[:, :qd].view(n, self.num_heads, d), L["q_norm"])
            k = self._norm(qkv[:, qd : qd + kd].view(n, self.num_kv_heads, d), L["k_norm"])
            qk = torch.cat([q, k], dim=1)
        else:
            qk = qkv[:, : qd + kd].view(n, self.num_heads + self.num_kv_heads, d)
        return torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)

    def _value(self, qkv: torch.Tensor) -> torch.Tensor:
        n, d = qkv.shape[0], self.head_dim
        return qkv[:, (self.num_heads + self.num_kv_heads) * d :].view(n, self.num_kv_heads, d)

    def _linear(self, L: dict, name: str, a: torch.Tensor) -> torch.Tensor:
        """``a @ W.T (+ b)`` for layer weight ``name`` (``qkv``, ``gate_up``), on ``self.matmul``'s kernel."""
        if self.matmul == "native":
            return native_linear(a, L[name + "_native"], L[name + "_w"].shape[0], L.get(name + "_b"))
        if self.matmul == "onednn":
            return torch.ops.mkldnn._linear_pointwise(a, L[name + "_packed"], L.get(name + "_b"), "none", [], "")
        return F.linear(a, L[name + "_w"], L.get(name + "_b"))

    def _linear_add(self, L: dict, name: str, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """``x + a @ W.T (+ b)`` for layer weight ``name`` (``o``, ``down``): the residual add fused into the matmul
        (in place in ``x`` on the native path), on ``self.matmul``'s kernel."""
        b = L.get(name + "_b")
        if self.matmul == "native":
            return native_linear(a, L[name + "_native"], x.shape[1], b, residual=x)
        if self.matmul == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(a.contiguous(), x, L[name + "_packed"], b, "add")
        out = torch.addmm(x, a, L[name + "_w"].t())
        return out if b is None else out.add_(b)

    def _mlp_and_residual(self, L: dict, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = self._linear_add(L, "o", x, attn)
        gu = self._linear(L, "gate_up", self._norm(x, L["post_norm"]))
        if self.native_passes:
            return self._linear_add(L, "down", x, silu_mul(gu))
        g, u = gu.chunk(2, dim=-1)
        return self._linear_add(L, "down", x, F.silu(g, inplace=True).mul_(u))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] of final-layer hidden states ``x`` [N, hidden] (the final norm, then the LM head); on
        CPU in a reused buffer (valid until the next forward).

        On CPU the vocabulary is cut into chunks whose slice of the head stays in cache: one
        [N, 49152] matmul ran ~25 % slower here than the chunked form (same values).
        """
        h = self._norm(x, self.final_norm)
        if self.matmul == "native":
            return native_linear(h, self.native.lm_head, self.lm_head.shape[0])
        if self.matmul == "onednn":
            return torch.ops.mkldnn._linear_pointwise(h, self.lm_head_packed, None, "none", [], "").float()
        if self.device.type != "cpu":
            return F.linear(h, self.lm_head).float()
        n, vocab = h.shape[0], self.lm_head.shape[0]
        if self._logits_buf is None or self._logits_buf.shape[0] < n:
            self._logits_buf = torch.empty(max(n, LOGITS_ROWS), vocab, dtype=self.dtype)
        out = self._logits_buf[:n]
        for j in range(0, vocab, LOGITS_CHUNK):
            torch.mm(h, self.lm_head[j : j + LOGITS_CHUNK].t(), out=out[:, j : j + LOGITS_CHUNK])
        return out.float()

    def release_logits_buffer(self) -> int:
        """Drop the CPU logits buffer (the next forward makes it again); the bytes it held (0 when there was none)."""
        if self._logits_buf is None:
            return 0
        freed, self._logits_buf = self._logits_buf.nbytes, None
        return freed

    def copy_block(self, src: int, dst: int, n: int) -> None:
        """K/V of the first ``n`` positions of block ``src`` into block ``dst`` (a partial prefix block's copy)."""
        self.cache.copy_block(src, dst, n)

    # ----------------------------------------------------------------- entry points
    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem]) -> torch.Tensor:
        """Run the new tokens of each item, write their K/V; return last-position logits [n, V].

        Per layer every item's K/V is written before any item attends, so an item may read blocks that
        an earlier item of the same batch writes (a shared prefix admitted in the same step)."""
        bs, h_q, kh = self.cache.block_size, self.num_heads, self.num_kv_heads
        lens = [len(it.token_ids) for it in items]
        tokens = torch.tensor([t for it in items for t in it.token_ids], device=self.device)
        positions = torch.cat([torch.arange(it.start_pos, it.start_pos + n) for it, n in zip(items, lens)])
        kv_slots = torch.cat([it.kv_slots(bs) for it in items])
        positions, kv_slots = positions.to(self.device), kv_slots.to(self.device)
        rows = None if self.native_passes else self.cache.flat_rows(kv_slots)
        tables = [
            torch.tensor(it.block_table[: -(-(it.start_pos + n) // bs)], device=self.device)[None]
            for it, n in zip(items, lens)
        ]
        x = F.embedding(tokens, self.embed)
        cos, sin = self._rope_tables(positions)
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        for li, L in enumerate(self.layers):
            qkv = self._linear(L, "qkv", self._norm(x, L["in_norm"]))
            if self.native_passes:  # norms, RoPE and every token's K/V write in one C pass
                self.native.rope_store(li, qkv, positions, kv_slots)
                heads = qkv.view(len(positions), -1, self.head_dim)
                qk, v = heads[:, : h_q + kh], heads[:, h_q + kh :]
            else:
                qk, v = self._qk_rope(L, qkv, cos, sin), self._value(qkv)
                self.cache.write(li, rows, qk[:, h_q:], v)
            outs = []
            for it, table, a, b in zip(items, tables, bounds[:-1], bounds[1:]):
                p, n = it.start_pos, b - a
                qi = qk[a:b, :h_q].transpose(0, 1).unsqueeze(0)
                if p == 0:  # nothing cached before: the new K/V as computed (what was just written)
                    ki, vi = qk[a:b, h_q:].transpose(0, 1).unsqueeze(0), v[a:b].transpose(0, 1).unsqueeze(0)
                    o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
                else:
                    ki, vi = self.cache.gather(li, table)
                    ki, vi = ki[:, :, : p + n], vi[:, :, : p + n]
                    mask = (
                        torch.arange(p + n, device=self.device)[None, :]
                        <= torch.arange(p, p + n, device=self.device)[:, None]
                    )
                    o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
                outs.append(o[0].transpose(0, 1).reshape(n, -1))
            x = self._mlp_and_residual(L, x, torch.cat(outs) if len(outs) > 1 else outs[0])
        last = torch.tensor([b - 1 for b in bounds[1:]], device=self.device)
        return self.logits(x[last])

    @torch.inference_mode()
    def hidden_states(self, prompts: list[list[int]]) -> torch.Tensor:
        """Final-layer hidden states ``[N, hidden]`` (before the final norm: ``logits`` applies it) of ``prompts``
        packed in order, each attending causally over its own tokens from position 0.

        The prefill's forward without the KV cache: the same fused matmuls, norms and RoPE tables over all tokens
        at once, attention per prompt over the K/V computed here and dropped after it. Nothing cached is read or
        written, so it may run between any two steps (prompt scoring, scoring.py)."""
        dev = self.device
        lens = [len(p) for p in prompts]
        tokens_N = torch.tensor([t for p in prompts for t in p], device=dev)
        positions_N = torch.cat([torch.arange(n) for n in lens]).to(dev)
        cos, sin = self._rope_tables(positions_N)
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        h = self.num_heads
        x = F.embedding(tokens_N, self.embed)
        for L in self.layers:
            qkv = self._linear(L, "qkv", self._norm(x, L["in_norm"]))
            qk, v = self._qk_rope(L, qkv, cos, sin), self._value(qkv)
            outs = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                q_i = qk[a:b, :h].transpose(0, 1).unsqueeze(0)
                k_i = qk[a:b, h:].transpose(0, 1).unsqueeze(0)
                v_i = v[a:b].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=True, enable_gqa=True)
                outs.append(o[0].transpose(0, 1).reshape(b - a, -1))
            x = self._mlp_and_residual(L, x, torch.cat(outs) if len(outs) > 1 else outs[0])
        return x

    def decode_forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        shared: Optional["SharedPrefixAttention"] = None,
    ) -> torch.Tensor:
        """One decode step, tensor ops only (CUDA-graph safe without ``shared``); logits [B, V].

        ``tables`` [B, W]: each row's block table padded with the null block; rows attend to the
        ``W x block_size`` keys of their blocks, masked past their position (padded rows of a CUDA
        graph: position 0 of a table of null blocks). ``shared``: attention by
        :class:`SharedPrefixAttention` instead.
        """
        b, dev, bs = tokens.shape[0], tokens.device, self.cache.block_size
        kh, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        kv_slot = tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        rows = self.cache.flat_rows(kv_slot)
        visible = torch.arange(tables.shape[1] * bs, device=dev)[None, :] <= positions[:, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=dev).masked_fill_(~visible, float("-inf"))
        mask = mask[:, None, None, :]
        x = F.embedding(tokens, self.embed)
        cos, sin = self._rope_tables(positions)
        for li, L in enumerate(self.layers):
            qkv = self._linear(L, "qkv", self._norm(x, L["in_norm"]))
            qk = self._qk_rope(L, qkv, cos, sin)
            self.cache.write(li, rows, qk[:, self.num_heads :], self._value(qkv))
            # GQA folded into the query axis: the `group` query heads of a kv head attend together
            qs = qk[:, : self.num_heads].view(b, kh, group, self.head_dim)
            if shared is not None:
                o = shared.attend(qs, self.cache.k[li], self.cache.v[li])
            else:
                k, v = self.cache.gather(li, tables)
                o = decode_attention(qs, k, v, mask)
            x = self._mlp_and_residual(L, x, o.reshape(b, -1))
        return self.logits(x)

    @torch.inference_mode()
    def decode(
        self,
        block_tables: list[list[int]],
        tokens: list[int],
        positions: list[int],
        shared_prefixes: Sequence[SharedPrefix] = (),
    ) -> torch.Tensor:
        """Decode one token for each row (``positions[i]`` = where ``tokens[i]`` goes, in the blocks of
        ``block_tables[i]``); logits [B, V].

        ``shared_prefixes``: groups of rows that share their leading blocks (GRPO group members,
        ``n > 1``); on CPU their attention reads that prefix once per group when it saves enough
        (``SHARED_ATTENTION_GAIN``), see :class:`SharedPrefixAttention`.
        """
        if self.graphs is not None:
            out = self.graphs.run(block_tables, tokens, positions)
            if out is not None:
                return out
        if self.native is not None:
            return self.native.decode(block_tables, tokens, positions, shared_prefixes)
        null = self.cache.null_block
        tables = padded_tables(block_tables, max(len(t) for t in block_tables), null)
        shared = None
        if shared_prefixes and self.device.type == "cpu":
            shared = SharedPrefixAttention.plan(
                positions, shared_prefixes, tables, self.cache.block_size, self.num_kv_heads, self.dtype
            )
        t = torch.tensor(tokens, device=self.device)
        p = torch.tensor(positions, device=self.device)
        return self.decode_forward(t, p, torch.tensor(tables, device=self.device), shared)
