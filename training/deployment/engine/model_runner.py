"""Lean forward for Llama / Qwen2 / Qwen3 decoders over the slot KV cache.

Same weights as the transformers model, read from the folder's safetensors, stored fused:
``qkv = [q; k; v]`` and ``gate_up = [gate; up]`` so a layer is four matmuls (plus biases where
the checkpoint has them: Qwen2's qkv bias, Llama's ``attention_bias`` / ``mlp_bias``). Qwen3's
per-head ``q_norm`` / ``k_norm`` are applied before RoPE, as transformers does. RMSNorm,
RoPE (``rope_parameters`` / ``rope_theta``, transformers' init functions for scaled variants)
and attention (SDPA, GQA) follow the transformers definitions, so greedy outputs match token
for token and fp32 logprobs to ~1e-5.

Two entry points, both return fp32 logits:
- ``prefill(items)``: new tokens of several sequences packed into one ``[N, hidden]`` batch for
  the matmuls; attention per sequence over its slot (cached prefix + new tokens).
- ``decode(slots, tokens, positions)``: one token per running sequence; attention over the
  slot rows ``[:S]`` of the cache, keys ``[:L]``, masked per row by its length, or, for rows
  that hold copies of one prefix (a GRPO group), ``SharedPrefixAttention``: the prefix read once.
On CUDA the decode step is replayed from CUDA graphs (cuda_graphs.py).

On CPU in fp32 the decode step runs in C by default (``native``, chosen by runners.py:
``NativeDecoder``, native.py), and so do the prefill's norms, RoPE, K/V writes and SiLU gate; ``decode_forward`` below
is the torch step (``decode_kernel="torch"``, bf16, CUDA, or no C compiler).

On CPU in fp32 (and in bf16 where the CPU has native bf16) the five matmuls (qkv, o, gate_up,
down, LM head) of the torch step and of every prefill run as oneDNN linears on weights reordered
once into oneDNN's blocked layout (``weights_changed``, called after every weight change). In fp32
they are 1.3–3.5× faster than
``F.linear`` (MKL, ~100 GFLOPS at 32 rows) at every batch size on the AMD EPYC this was measured
on. The reordered copies double the weights' memory. The fp32 sums run in another order than
MKL's, so logits move by ~1e-6 relative; the trainer-side exactness figure is in BENCHMARKS.md
("exactness").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from training.deployment.engine.attention import SharedPrefix, SharedPrefixAttention, decode_attention
from training.deployment.engine.kv_cache import KVCache
from training.deployment.engine.native import NativeDecoder, silu_mul
from training.deployment.engine.native import rms_norm as native_rms_norm
from training.deployment.engine.weights import checkpoint_shapes, load_safetensors

log = logging.getLogger(__name__)

LEAN_MODEL_TYPES = ("llama", "qwen2", "qwen3")
LOGITS_CHUNK = 4096
"""Vocabulary rows of the LM head per matmul on CPU without oneDNN (a chunk of the head stays in cache)."""
PACK_BATCH = 32
"""Batch size oneDNN's weight reorder is tuned for (any batch size runs on the packed weights)."""


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN linears on reordered weights: CPU, a torch built with mkldnn, fp32 (or bf16 where the CPU has it)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass
class PrefillItem:
    """New tokens of one sequence: ``token_ids`` go to positions ``start_pos ..`` of ``slot``."""

    slot: int
    token_ids: list[int]
    start_pos: int


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
        num_slots: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        native: bool,
    ):
        """``native``: run the decode step in C (``NativeDecoder``; raises NativeUnavailable where it cannot).
        The engine decides it once, in runners.py (``build_runner``); this class has no default of its own."""
        reason = lean_supported(config)
        if reason:
            raise ValueError(f"lean forward cannot run this model: {reason}")
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
        self.onednn = onednn_linear_available(device, dtype)
        """The matmuls run as oneDNN linears on reordered weights (``weights_changed`` makes them)."""
        self.lm_head_packed: torch.Tensor | None = None
        self._allocate(self.weight_shapes)
        self.load_weights(load_safetensors(path))
        inv, scale = _rope_inv_freq(config, self.head_dim)
        pos = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        sin = emb.sin() * scale
        self.sin_signed = torch.cat([-sin[:, : self.head_dim // 2], sin[:, self.head_dim // 2 :]], -1).to(
            dtype=dtype, device=device
        )
        self.max_len = max_model_len
        self.cache = KVCache(self.num_layers, num_slots, self.num_kv_heads, max_model_len, self.head_dim, dtype, device)
        self._logits_buf: torch.Tensor | None = None
        self._logits_rows = num_slots
        self.graphs = None  # CudaGraphDecoder, set by the engine on CUDA
        self.native: Optional[NativeDecoder] = NativeDecoder(self) if native else None
        """The decode step in C (native.py), or None: torch ops (``decode_forward``)."""

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

    @torch.inference_mode()
    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a validated full set into the fused tensors in place (CUDA graphs stay valid)."""
        try:
            for name, target in self.targets.items():
                target.copy_(tensors[name])
        finally:
            self.weights_changed()

    def weights_changed(self) -> None:
        """Refresh what is derived from ``targets`` (the oneDNN and native copies); whoever writes ``targets`` calls it.
        While the runner sleeps (``sleeping``, sleep.py) nothing is derived: waking rebuilds the copies."""
        if getattr(self, "sleeping", False):
            return
        if getattr(self, "native", None) is not None:
            self.native.pack_weights()
        if not self.onednn:
            return
        with torch.inference_mode():
            for L in self.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    L[name + "_packed"] = torch.ops.mkldnn._reorder_linear_weight(L[name + "_w"], PACK_BATCH)
            self.lm_head_packed = torch.ops.mkldnn._reorder_linear_weight(self.lm_head, PACK_BATCH)

    # ----------------------------------------------------------------- forward pieces
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dim() == 2:
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

    @staticmethod
    def _linear(L: dict, name: str, a: torch.Tensor) -> torch.Tensor:
        """``a @ W.T (+ b)`` for layer weight ``name`` (``qkv``, ``gate_up``)."""
        packed = L.get(name + "_packed")
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(a, packed, L.get(name + "_b"), "none", [], "")
        return F.linear(a, L[name + "_w"], L.get(name + "_b"))

    @staticmethod
    def _linear_add(L: dict, name: str, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """``x + a @ W.T (+ b)`` for layer weight ``name`` (``o``, ``down``): the residual add fused into the matmul."""
        packed, b = L.get(name + "_packed"), L.get(name + "_b")
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(a.contiguous(), x, packed, b, "add")
        out = torch.addmm(x, a, L[name + "_w"].t())
        return out if b is None else out.add_(b)

    def _mlp_and_residual(self, L: dict, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = self._linear_add(L, "o", x, attn)
        gu = self._linear(L, "gate_up", self._norm(x, L["post_norm"]))
        if self.native is not None:
            return self._linear_add(L, "down", x, silu_mul(gu))
        g, u = gu.chunk(2, dim=-1)
        return self._linear_add(L, "down", x, F.silu(g, inplace=True).mul_(u))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V]; on CPU in a reused buffer (valid until the next forward).

        On CPU the vocabulary is cut into chunks whose slice of the head stays in cache: one
        [N, 49152] matmul ran ~25 % slower here than the chunked form (same values).
        """
        h = self._norm(x, self.final_norm)
        if self.lm_head_packed is not None:
            return torch.ops.mkldnn._linear_pointwise(h, self.lm_head_packed, None, "none", [], "").float()
        if self.device.type != "cpu":
            return F.linear(h, self.lm_head).float()
        n, vocab = h.shape[0], self.lm_head.shape[0]
        if self._logits_buf is None or self._logits_buf.shape[0] < n:
            self._logits_buf = torch.empty(max(n, self._logits_rows), vocab, dtype=self.dtype)
        out = self._logits_buf[:n]
        for j in range(0, vocab, LOGITS_CHUNK):
            torch.mm(h, self.lm_head[j : j + LOGITS_CHUNK].t(), out=out[:, j : j + LOGITS_CHUNK])
        return out.float()

    def copy_kv(self, src: int, dst: int, n: int) -> None:
        """K/V positions ``[0, n)`` of slot ``src`` into slot ``dst`` (prefix reuse, compaction)."""
        self.cache.copy(src, dst, n)

    # ----------------------------------------------------------------- entry points
    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem]) -> torch.Tensor:
        """Run the new tokens of each item, write their K/V; return last-position logits [n, V]."""
        lens = [len(it.token_ids) for it in items]
        tokens = torch.tensor([t for it in items for t in it.token_ids], device=self.device)
        positions = torch.cat([torch.arange(it.start_pos, it.start_pos + n) for it, n in zip(items, lens)])
        positions = positions.to(self.device)
        x = F.embedding(tokens, self.embed)
        cos, sin = self._rope_tables(positions)
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        h_q = self.num_heads
        if self.native is not None:
            token_slots = torch.cat([torch.full((n,), it.slot, dtype=torch.int64) for it, n in zip(items, lens)])
        for li, L in enumerate(self.layers):
            qkv = self._linear(L, "qkv", self._norm(x, L["in_norm"]))
            kc, vc = self.cache.k[li], self.cache.v[li]
            if self.native is not None:  # norms, RoPE and every token's K/V write in one C pass
                self.native.rope_store(li, qkv, positions, token_slots)
                qk = qkv.view(len(positions), -1, self.head_dim)
            else:
                qk, v = self._qk_rope(L, qkv, cos, sin), self._value(qkv)
                for it, a, b in zip(items, bounds[:-1], bounds[1:]):
                    s, p = it.slot, it.start_pos
                    kc[s, :, p : p + b - a] = qk[a:b, h_q:].transpose(0, 1)
                    vc[s, :, p : p + b - a] = v[a:b].transpose(0, 1)
            outs = []
            for it, a, b in zip(items, bounds[:-1], bounds[1:]):
                s, p, n = it.slot, it.start_pos, b - a
                qi = qk[a:b, :h_q].transpose(0, 1).unsqueeze(0)
                ki, vi = kc[s : s + 1, :, : p + n], vc[s : s + 1, :, : p + n]
                if p == 0:
                    o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
                else:
                    mask = (
                        torch.arange(p + n, device=self.device)[None, :]
                        <= torch.arange(p, p + n, device=self.device)[:, None]
                    )
                    o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
                outs.append(o[0].transpose(0, 1).reshape(n, -1))
            x = self._mlp_and_residual(L, x, torch.cat(outs) if len(outs) > 1 else outs[0])
        last = torch.tensor([b - 1 for b in bounds[1:]], device=self.device)
        return self._logits(x[last])

    def decode_forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        num_rows: int,
        key_len: int,
        compact: bool,
        shared: Optional["SharedPrefixAttention"] = None,
    ) -> torch.Tensor:
        """One decode step, tensor ops only (CUDA-graph safe without ``shared``); logits [B, V].

        ``num_rows``: cache rows attended (> every slot used); ``key_len``: keys attended
        (> every position); ``compact``: slots == arange(B), so rows need no scatter/gather.
        The engine keeps running sequences in slots ``[0, B)``, so it always decodes compact and
        attends over exactly the live rows and the keys up to the longest live position.
        ``shared``: attention by :class:`SharedPrefixAttention` instead (compact only).
        """
        b, dev = tokens.shape[0], tokens.device
        kh, group, d, max_len = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim, self.max_len
        lens = torch.zeros(num_rows, dtype=torch.long, device=dev)
        lens[slots] = positions + 1
        visible = torch.arange(key_len, device=dev)[None, :] < lens.clamp(min=1)[:, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=dev).masked_fill_(~visible, float("-inf"))
        mask = mask[:, None, None, :]
        # flat row of (slot, kv head, position) in a layer's [slots + 1, K, max_len, d] cache, shared by all layers
        rows = ((slots * kh)[:, None] + torch.arange(kh, device=dev)[None, :]) * max_len + positions[:, None]
        rows = rows.reshape(-1)
        x = F.embedding(tokens, self.embed)
        cos, sin = self._rope_tables(positions)
        for li, L in enumerate(self.layers):
            qkv = self._linear(L, "qkv", self._norm(x, L["in_norm"]))
            qk = self._qk_rope(L, qkv, cos, sin)
            kc, vc = self.cache.k[li], self.cache.v[li]
            kc.view(-1, d)[rows] = qk[:, self.num_heads :].reshape(-1, d)
            vc.view(-1, d)[rows] = self._value(qkv).reshape(-1, d)
            # GQA folded into the query axis: the `group` query heads of a kv head attend together
            if compact:
                qs = qk[:, : self.num_heads].view(b, kh, group, d)
            else:
                qs = qk.new_zeros(num_rows, kh, group, d)
                qs[slots] = qk[:, : self.num_heads].reshape(b, kh, group, d)
            if shared is not None:
                o = shared.attend(qs, kc, vc)
            else:
                o = decode_attention(qs, kc[:num_rows, :, :key_len], vc[:num_rows, :, :key_len], mask)
                o = o if compact else o[slots]
            x = self._mlp_and_residual(L, x, o.reshape(b, -1))
        return self._logits(x)

    @torch.inference_mode()
    def decode(
        self,
        slots: list[int],
        tokens: list[int],
        positions: list[int],
        shared_prefixes: Sequence[SharedPrefix] = (),
    ) -> torch.Tensor:
        """Decode one token for each row (``positions[i]`` = where ``tokens[i]`` goes); logits [B, V].

        ``shared_prefixes``: groups of rows whose prefix K/V is the same (GRPO group members,
        ``n > 1``); on CPU their attention reads that prefix once per group when it saves enough
        (``SHARED_ATTENTION_GAIN``), see :class:`SharedPrefixAttention`.
        """
        if self.graphs is not None:
            out = self.graphs.run(slots, tokens, positions)
            if out is not None:
                return out
        if self.native is not None:
            return self.native.decode(slots, tokens, positions, shared_prefixes)
        compact = slots == list(range(len(slots)))
        shared = None
        if compact and shared_prefixes and self.device.type == "cpu":
            shared = SharedPrefixAttention.plan(positions, shared_prefixes, self.num_kv_heads, self.max_len, self.dtype)
        t = torch.tensor(tokens, device=self.device)
        p = torch.tensor(positions, device=self.device)
        s = torch.tensor(slots, device=self.device)
        return self.decode_forward(t, p, s, max(slots) + 1, max(positions) + 1, compact, shared)

    def release(self, slot: int) -> None:
        """Nothing to do: a slot's stale K/V is overwritten before it is attended again."""
