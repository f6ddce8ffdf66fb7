"""The decode step in C on CPU (fp32 or bf16): one call per step instead of ~40 torch ops per layer.

``native_decode.c`` holds the whole decode forward of the lean runner (embedding, 30 × (norm,
matmuls, RoPE, K/V write, attention, SiLU), final norm, LM head). It is compiled on first use with
the machine's C compiler (``$CC`` or ``gcc``; ``-O3 -march=native -fopenmp``) into
``$TRAINING_CACHE/native/`` (keyed by the source, the flags, the compiler and the CPU, so another
CPU or a changed source compiles anew), and loaded with ``ctypes``. Nothing else is installed:
where no compiler works the engine keeps the torch path (``decode_kernel="auto"``).

What it buys (engine README, "The native decode step"): the matmuls stream weights packed in
panels of 32 output columns and prefetch the next panel while computing the current one (a decode
step reads every weight from memory once; on oneDNN's reordered weights the same matmuls took
1.5–1.9× as long);
attention is one online-softmax pass per (segment, kv head) that reads a GRPO group's shared
prefix once for all its rows; the norms, RoPE and SiLU cost no op dispatch.

Contract: the same maths as ``LeanModelRunner.decode_forward`` in fp32, the sums in another order
(tested: logits within 1e-4 of the torch path, greedy tokens equal, over churn and shared
prefixes). In bf16 (a second library, built with ``-DNATIVE_BF16``) the matmul weights, the embedding
and the K/V pool stay bf16 and everything else runs in fp32 (the residual stream, the norms, RoPE,
softmax, SiLU, every accumulation): the matmuls run on AMX tiles where the CPU has them (their inputs
rounded to bf16), elsewhere with the weights widened to fp32 as they stream (``BF16_MATMULS``). It is
closer to fp32 than the bf16 torch step, which rounds after every op (tested). OpenMP runs on the
libgomp torch already loaded (same soname), so the engine's thread count (``torch.set_num_threads``)
applies and there is one worker pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from training.deployment.engine.kv_cache import padded_tables
from training.utils.cache import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_decode.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math") + (
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
)
"""gcc's: the 16-float vectors are one register on AVX-512 (two on AVX2); the loops it vectorises itself use 512 bits too."""
CPU_ISA_ENV = "TRAINING_CPU_ISA"
"""Environment variable naming the instruction sets the library may use (``CPU_ISAS``; default ``native``): a CPU
with AMX builds the paths of one without it (``no_amx``: an AMD EPYC with AVX-512 BF16) or without AVX-512
(``avx2``), so one machine tests the kernels every user's CPU runs. Pair it with ``ONEDNN_MAX_CPU_ISA`` for
torch's own kernels (README, "Testing the other CPUs' paths")."""
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
CPU_ISAS = {"native": (), "no_amx": _NO_AMX, "avx2": (*_NO_AMX, "-mno-avx512f")}
"""gcc flags added after ``-march=native`` per ``TRAINING_CPU_ISA`` value (``-mno-avx512f`` drops every AVX-512 subset)."""
DTYPE_FLAGS = {torch.float32: (), torch.bfloat16: ("-DNATIVE_BF16",)}
"""The library built per engine dtype: fp32, or bf16 weights and K/V (native_decode.c's file comment)."""
BF16_MATMULS = {"auto": ("-DNATIVE_BF16_AMX",), "widen": (), "vdpbf16ps": ("-DNATIVE_BF16_DOT",)}
"""The bf16 builds' matmul kernels: ``widen`` (bf16 weights widened to fp32 as they stream; every CPU), ``auto``
(AMX tiles where the CPU has AMX, else ``widen``), ``vdpbf16ps`` (AVX-512 BF16 where the CPU has it, else
``widen``); AMX and ``vdpbf16ps`` round the activations to bf16."""
BF16_MATMUL = "auto"
"""The bf16 kernel the engine builds (engine README, "The native step in bf16": the fastest measured)."""
MATMULS = ("qkv", "o", "gate_up", "down")
"""A layer's fused matmuls, by the runner's weight names (``L[name + "_w"]``, ``L[name + "_b"]``)."""
PANEL_COLUMNS = 32
"""Output columns per packed weight panel (``NB`` in native_decode.c): ``pack_weight`` lays a [N, K] weight out
as [ceil(N / 32)][K][32], the columns past N zero."""
SEGMENT_ROWS = 8
"""Most rows of one attention segment: a bigger GRPO group is split, so its tasks spread over the threads."""
LOGITS_ROWS = 64
"""Rows the logits buffer is first made for (it grows to the largest batch)."""
GEMM_MIN_ROWS = 1024
"""From this many rows an fp32 ``linear`` runs torch's GEMM (MKL) on the panels, laid out again a slice at a time
(``_gemm_on_panels``): a prefill of 1,000-5,000 tokens took 0.90-0.97× the time so; at 256-512 it took 1.02-1.09×
(engine README, "The native decode step")."""
GEMM_SLICE_COLUMNS = 512
"""Output columns (16 panels) laid out per GEMM call: a [K, 512] fp32 slice (1.2 MB at K = 576), read by the GEMM
while still in cache; the scratch never holds a whole weight (the LM head is 113 MB on SmolLM2)."""

P = ctypes.c_void_p
PP = ctypes.POINTER(ctypes.c_void_p)


class NativeUnavailable(RuntimeError):
    """The native decode step cannot be built or used here (the message says why)."""


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int32) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim")),
        *((name, ctypes.c_int32) for name in ("inter", "vocab", "block_size", "num_blocks")),
        ("eps", ctypes.c_float),
        *((name, PP) for name in ("in_norm", "post_norm", "qkv_w", "o_w", "gate_up_w", "down_w")),
        *((name, PP) for name in ("qkv_b", "o_b", "gate_up_b", "down_b", "q_norm", "k_norm")),
        ("k_cache", P),
        ("v_cache", P),
        ("embed", P),
        ("final_norm", P),
        ("lm_head", P),
        ("cos", P),
        ("sin_signed", P),
    ]


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU's model name and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _library_path(compiler: str, flags: tuple[str, ...]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(flags), version, _cpu_identity()]).encode())
    return cache_dir() / "native" / f"native_decode-{key.hexdigest()[:16]}.so"


def cpu_isa() -> str:
    """``TRAINING_CPU_ISA`` (``native`` when unset); a value not in ``CPU_ISAS`` is a ValueError naming it."""
    isa = os.environ.get(CPU_ISA_ENV, "native")
    if isa not in CPU_ISAS:
        raise ValueError(f"{CPU_ISA_ENV}={isa!r} is not one of {tuple(CPU_ISAS)}")
    return isa


def load_library(profile: bool = False, dtype: torch.dtype = torch.float32, matmuls: str = BF16_MATMUL) -> ctypes.CDLL:
    """The compiled library for ``dtype`` (fp32 or bf16; built on first use, then cached on disk); raises
    NativeUnavailable.

    The outcome is kept for the process, a failure too (no compiler run per call);
    ``load_library.cache_clear()`` forgets it. ``profile``: the build whose ``decode_step`` times
    its phases (``PHASES``; benchmarks/profile_decode.py reads them). ``matmuls``: the bf16 build's matmul
    kernel (``BF16_MATMULS``).
    """
    if dtype not in DTYPE_FLAGS:
        raise NativeUnavailable(f"dtype {dtype} (the native step runs float32 and bfloat16)")
    if matmuls not in BF16_MATMULS:
        raise ValueError(f"matmuls={matmuls!r} is not one of {tuple(BF16_MATMULS)}")
    kernel = matmuls if dtype == torch.bfloat16 else BF16_MATMUL
    built = _build_and_load(profile, str(dtype).removeprefix("torch."), kernel, cpu_isa())
    if isinstance(built, NativeUnavailable):
        raise built
    return built


PHASES = ("embedding and norms", "layer matmuls", "RoPE and K/V writes", "attention", "SiLU gate", "LM head")
"""What the profile build's ``native_phase_seconds`` counts, in order."""


@functools.lru_cache(maxsize=8)
def _build_and_load(profile: bool, dtype_name: str, matmuls: str, isa: str) -> ctypes.CDLL | NativeUnavailable:
    compiler = os.environ.get("CC") or "gcc"
    if shutil.which(compiler) is None:
        return NativeUnavailable(f"no C compiler: {compiler!r} is not on PATH (set CC to one)")
    flags = (
        CFLAGS + CPU_ISAS[isa] + DTYPE_FLAGS[getattr(torch, dtype_name)] + (("-DNATIVE_PROFILE",) if profile else ())
    )
    flags += BF16_MATMULS[matmuls] if dtype_name == "bfloat16" else ()
    try:
        path = _library_path(compiler, flags)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
            try:
                cmd = [compiler, *flags, "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-lm"]
                log.info("compiling %s (once per source and CPU)", SOURCE.name)
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if done.returncode != 0:
                    return NativeUnavailable(f"compiling {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
                os.replace(tmp, path)  # atomic: a concurrent server either sees the whole file or none
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(path))  # torch (imported above) loaded its libgomp first: the library binds to it
    except (OSError, subprocess.SubprocessError) as exc:
        return NativeUnavailable(f"native decode step unavailable: {exc}")
    i32, i64p, i32p = ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)
    lib.decode_step.argtypes = [ctypes.POINTER(_Model), i32, i64p, i64p, i32p, i32, i32, i32p, i32p, i32p, P]
    lib.decode_step.restype = ctypes.c_int
    lib.matmul.argtypes = [i32, i32, i32, P, P, P, P, P]
    lib.matmul.restype = None
    lib.pack_weight.argtypes = [i32, i32, P, P]
    lib.pack_weight.restype = None
    lib.packed_size.argtypes = [i32, i32]
    lib.packed_size.restype = ctypes.c_size_t
    lib.matmul_rounds_activations.argtypes = []
    lib.matmul_rounds_activations.restype = ctypes.c_int
    lib.sample_plain.argtypes = [i32, i32, P, P, P, P, P, P]
    lib.sample_plain.restype = None
    lib.rope_store.argtypes = [ctypes.POINTER(_Model), i32, P, i32, P, P]
    lib.rope_store.restype = None
    lib.rmsnorm_rows.argtypes = [P, P, P, i32, i32, ctypes.c_float]
    lib.rmsnorm_rows.restype = None
    lib.silu_mul.argtypes = [P, P, i32, i32]
    lib.silu_mul.restype = None
    return lib


load_library.cache_clear = _build_and_load.cache_clear


def native_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the native decode step can run here, else the reason it cannot."""
    if device.type != "cpu":
        return f"device {device.type} (the native step is CPU only)"
    try:
        load_library(dtype=dtype)
    except NativeUnavailable as exc:
        return str(exc)
    return None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def pack_weight(w: torch.Tensor, out: torch.Tensor | None = None, matmuls: str = BF16_MATMUL) -> torch.Tensor:
    """``w`` [N, K] (fp32 or bf16) in the matmul's panel layout (fp32 ``[ceil(N/32)][K][32]``, columns past N
    zero; bf16 the same with each k's columns interleaved, or in pairs along K for ``vdpbf16ps`` / ``amx``), flat, in
    ``w``'s dtype; into ``out`` (a buffer of that size, rewritten in place) when given."""
    lib = load_library(dtype=w.dtype, matmuls=matmuls)
    n, k = w.shape
    w = w.contiguous()
    if w.untyped_storage().nbytes() < w.storage_offset() * 4 + w.nbytes:  # its memory given back (model_runner)
        raise ValueError(f"pack_weight: the {n}x{k} weight holds no memory (a runner's unheld matmul weight)")
    size = lib.packed_size(n, k)
    if out is None:
        out = torch.empty(size, dtype=w.dtype)
    elif out.numel() != size or not out.is_contiguous() or out.dtype != w.dtype:
        raise ValueError(f"pack_weight: out holds {out.numel()} floats, the panels of a {n}x{k} weight {size}")
    lib.pack_weight(n, k, w.data_ptr(), out.data_ptr())
    return out


def unpack_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [n, k] weight laid out again from its fp32 panels (``pack_weight``'s inverse), as a new tensor."""
    return packed.view(-1, k, PANEL_COLUMNS).transpose(1, 2).reshape(-1, k)[:n]


def linear(
    a: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    matmuls: str = BF16_MATMUL,
) -> torch.Tensor:
    """``a @ w.T (+ bias) (+ residual)`` for ``packed = pack_weight(w, matmuls=matmuls)`` (``w`` has ``n`` rows);
    ``a``, ``bias``, ``residual`` and the result fp32 on CPU, ``packed`` fp32 or bf16.

    ``bias`` is padded to whole panels here; ``residual`` [M, n] is added in the same pass and may be
    the output buffer itself (it is then updated in place and returned). From ``GEMM_MIN_ROWS`` rows an fp32
    ``packed`` goes to torch's GEMM instead (``_gemm_on_panels``; the same sums in another order).
    """
    a = a.contiguous()
    m, k = a.shape
    out = residual if residual is not None else torch.empty(m, n, dtype=torch.float32)
    if packed.dtype == torch.float32 and m >= GEMM_MIN_ROWS:
        _gemm_on_panels(a, packed, out, accumulate=residual is not None)
        return out if bias is None else out.add_(bias)
    bias = _pad(bias)
    lib = load_library(dtype=packed.dtype, matmuls=matmuls)
    lib.matmul(m, n, k, a.data_ptr(), packed.data_ptr(), _ptr(bias), _ptr(residual), out.data_ptr())
    return out


def _gemm_on_panels(a: torch.Tensor, packed: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= a @ w.T`` for fp32 panels of ``w``: each slice of ``GEMM_SLICE_COLUMNS`` columns copied back to
    [K, columns] in a scratch, then one ``addmm_`` into ``out``'s columns (``accumulate``: added to what ``out`` holds,
    else written over it)."""
    k, n = a.shape[1], out.shape[1]
    panels = packed.view(-1, k, PANEL_COLUMNS)
    per_slice = GEMM_SLICE_COLUMNS // PANEL_COLUMNS
    scratch = torch.empty(k * GEMM_SLICE_COLUMNS, dtype=torch.float32)
    for p0 in range(0, panels.shape[0], per_slice):
        p1 = min(p0 + per_slice, panels.shape[0])
        w = scratch[: k * (p1 - p0) * PANEL_COLUMNS].view(k, p1 - p0, PANEL_COLUMNS)
        w.copy_(panels[p0:p1].transpose(0, 1))
        j0, j1 = p0 * PANEL_COLUMNS, min(p1 * PANEL_COLUMNS, n)
        out[:, j0:j1].addmm_(a, w.view(k, -1)[:, : j1 - j0], beta=1 if accumulate else 0)


def sample_plain(
    logits_BV: torch.Tensor, temps_B: torch.Tensor, u_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, reported logprob, ok) per row of fp32 CPU logits, sampled at temperature alone (T > 0).

    token_sampler.py's plain-row draw (inverse CDF over blocks of 256) and logprob (``log_softmax(z / T)``)
    in two reads of each row; ok is False for a row with no finite mass (NaN or +inf logits).
    """
    logits_BV, temps_B, u_B = logits_BV.contiguous(), temps_B.float().contiguous(), u_B.float().contiguous()
    b, v = logits_BV.shape
    tokens, logprobs, ok = torch.empty(b, dtype=torch.int64), torch.empty(b), torch.empty(b, dtype=torch.int32)
    load_library().sample_plain(b, v, *(t.data_ptr() for t in (logits_BV, temps_B, u_B, tokens, logprobs, ok)))
    return tokens, logprobs, ok.bool()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * w`` over the last axis of a contiguous fp32 ``x`` [rows, n]."""
    x = x.contiguous()
    out = torch.empty_like(x)
    load_library().rmsnorm_rows(out.data_ptr(), x.data_ptr(), w.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``gate_up = [g u]`` [rows, 2 I] (contiguous fp32); returns [rows, I]."""
    gate_up = gate_up.contiguous()
    m, two_i = gate_up.shape
    out = torch.empty(m, two_i // 2)
    load_library().silu_mul(out.data_ptr(), gate_up.data_ptr(), m, two_i // 2)
    return out


def _pad(b: torch.Tensor | None) -> torch.Tensor | None:
    """A bias in fp32 padded with zeros to whole panels of 32 (the matmul adds it a panel at a time)."""
    if b is None:
        return None
    return torch.cat([b.float(), b.new_zeros(-b.numel() % 32, dtype=torch.float32)]).contiguous()


def _i64(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class NativeDecoder:
    """The decode step of a ``LeanModelRunner`` (``runner``) in C; it shares the runner's weights' values and block pool.

    Holds its own packed copy of the matmul weights (``pack_weights``, called from the runner's
    ``weights_changed``), and views of the runner's norms, embedding, RoPE tables and cache; in bf16
    fp32 copies of the norms (refreshed by ``pack_weights``) and the runner's fp32 RoPE tables.
    ``matmuls``: the bf16 build's matmul kernel (``BF16_MATMULS``).
    """

    def __init__(self, runner, profile: bool = False, matmuls: str = BF16_MATMUL):
        if runner.head_dim > 1024:
            raise NativeUnavailable(f"head_dim {runner.head_dim} > 1024")
        self.lib = load_library(profile, runner.dtype, matmuls)
        self.profile, self.matmuls = profile, matmuls
        self.runner = runner
        self.elementwise = runner.dtype == torch.float32
        """The prefill's norms, RoPE, K/V writes and SiLU gate run in this library too (fp32; bf16 keeps torch's)."""
        layers = runner.layers
        self.packed = {name: [pack_weight(L[name + "_w"], matmuls=matmuls) for L in layers] for name in MATMULS}
        """Per matmul name, per layer: the packed weight (rewritten in place by ``pack_weights``)."""
        self.biases = {name: [_pad(L.get(name + "_b")) for L in layers] for name in MATMULS}
        self.lm_head = pack_weight(runner.lm_head, matmuls=matmuls)
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(runner tensor, its fp32 copy) for what the step reads in fp32 that a bf16 runner holds in bf16."""
        self.norms = {n: [self._fp32(L.get(n)) for L in layers] for n in ("in_norm", "post_norm", "q_norm", "k_norm")}
        self.final_norm = self._fp32(runner.final_norm)
        self.model, self._keep = self._struct()
        self._logits = torch.empty(0)

    def repoint(self) -> None:
        """Rebuild the C side's pointer table from the tensors' current storage: whoever gives the weights or the KV
        cache new memory (a wake, sleep.py) calls it before the next decode."""
        self.model, self._keep = self._struct()

    def release_logits_buffer(self) -> None:
        """Drop the decode step's logits buffer (the next decode makes it again, at least its batch's size)."""
        self._logits = torch.empty(0)

    def _fp32(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` itself if fp32, else an fp32 copy kept current by ``pack_weights``."""
        if t is None or t.dtype == torch.float32:
            return t
        copy = t.float()
        self._copies.append((t, copy))
        return copy

    @torch.inference_mode()
    def pack_weights(self) -> None:
        """Repack the runner's current matmul weights and biases into this decoder's buffers, in place
        (the runner's ``weights_changed`` calls it after every weight update; no second copy is made)."""
        for i in range(len(self.runner.layers)):
            self.pack_layer(i)
        self.pack_head()

    def pack_layer(self, i: int) -> None:
        """Layer ``i``'s matmul weights and biases into its panels, in place."""
        L = self.runner.layers[i]
        for name in MATMULS:
            pack_weight(L[name + "_w"], out=self.packed[name][i], matmuls=self.matmuls)
            bias = self.biases[name][i]
            if bias is not None:
                bias[: L[name + "_b"].numel()].copy_(L[name + "_b"])

    def pack_head(self) -> None:
        """The LM head into its panels, and the copies kept of other weights (bf16: the norms in fp32) refreshed."""
        pack_weight(self.runner.lm_head, out=self.lm_head, matmuls=self.matmuls)
        for src, copy in self._copies:
            copy.copy_(src)

    def _struct(self) -> tuple[_Model, list]:
        """The ``Model`` struct the C side reads, and every object whose address it holds."""
        r = self.runner
        layers = r.layers
        keep: list = []

        def table(tensors: list[torch.Tensor | None]):
            if all(t is None for t in tensors):
                return None
            keep.extend(t for t in tensors if t is not None)
            return (ctypes.c_void_p * len(tensors))(*[_ptr(t) for t in tensors])

        m = _Model()
        m.num_layers, m.hidden, m.num_heads, m.num_kv_heads = r.num_layers, r.hidden, r.num_heads, r.num_kv_heads
        m.head_dim, m.inter, m.vocab = r.head_dim, layers[0]["down_w"].shape[1], r.vocab_size
        m.block_size, m.num_blocks, m.eps = r.cache.block_size, r.cache.num_blocks, r.eps
        tables = {
            **self.norms,
            **{f"{name}_w": self.packed[name] for name in MATMULS},
            **{f"{name}_b": self.biases[name] for name in MATMULS},
        }
        for name, tensors in tables.items():
            arr = table(tensors)
            keep.append(arr)
            setattr(m, name, ctypes.cast(arr, PP) if arr is not None else None)
        for name, t in (
            ("k_cache", r.cache.k_all),
            ("v_cache", r.cache.v_all),
            ("embed", r.embed),
            ("final_norm", self.final_norm),
            ("lm_head", self.lm_head),
            ("cos", r.rope_fp32[0]),
            ("sin_signed", r.rope_fp32[1]),
        ):
            if not t.is_contiguous():
                raise NativeUnavailable(f"{name} is not contiguous")
            keep.append(t)
            setattr(m, name, t.data_ptr())
        return m, keep

    def phase_seconds(self, reset: bool = True) -> dict[str, float]:
        """Seconds per phase (``PHASES``) summed over the decode steps so far; profile build only."""
        if not self.profile:
            raise RuntimeError("phase_seconds needs NativeDecoder(runner, profile=True)")
        seconds = (ctypes.c_double * len(PHASES)).in_dll(self.lib, "native_phase_seconds")
        out = dict(zip(PHASES, seconds))
        if reset:
            ctypes.memset(seconds, 0, ctypes.sizeof(seconds))
        return out

    def rope_store(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, kv_slots: torch.Tensor) -> None:
        """Prefill: per-head norms (Qwen3) and RoPE on the q and k heads of ``qkv`` [N, (H + 2K) d] in place, and
        each token's k and v written into the pool at its KV slot ``kv_slots[i]`` (block x block_size + offset;
        int64 [N], as ``positions``). fp32 only (``elementwise``)."""
        assert self.elementwise and qkv.is_contiguous() and positions.dtype == kv_slots.dtype == torch.int64
        positions, kv_slots = positions.contiguous(), kv_slots.contiguous()
        self.lib.rope_store(
            ctypes.byref(self.model), layer, qkv.data_ptr(), qkv.shape[0], positions.data_ptr(), kv_slots.data_ptr()
        )

    @torch.inference_mode()
    def decode(
        self,
        block_tables: list[list[int]],
        tokens: list[int],
        positions: list[int],
        shared_prefixes: Sequence = (),
    ) -> torch.Tensor:
        """Logits [B, V] (a buffer reused by the next call); same arguments as ``LeanModelRunner.decode``."""
        b = len(block_tables)
        starts, rows, prefixes = segments(positions, shared_prefixes)
        if self._logits.shape[0] < b:
            self._logits = torch.empty(max(b, LOGITS_ROWS), self.runner.vocab_size)
        out = self._logits[:b]
        t, p = _i64(tokens), _i64(positions)
        width = max(len(tb) for tb in block_tables)
        tables = torch.tensor(padded_tables(block_tables, width, self.runner.cache.null_block), dtype=torch.int32)
        st = torch.tensor(starts, dtype=torch.int32)
        ro = torch.tensor(rows, dtype=torch.int32)
        pr = torch.tensor(prefixes, dtype=torch.int32)
        i64p, i32p = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)
        rc = self.lib.decode_step(
            ctypes.byref(self.model),
            b,
            ctypes.cast(t.data_ptr(), i64p),
            ctypes.cast(p.data_ptr(), i64p),
            ctypes.cast(tables.data_ptr(), i32p),
            width,
            len(prefixes),
            ctypes.cast(st.data_ptr(), i32p),
            ctypes.cast(ro.data_ptr(), i32p),
            ctypes.cast(pr.data_ptr(), i32p),
            out.data_ptr(),
        )
        if rc != 0:
            raise MemoryError("native decode step: a work buffer could not be allocated")
        return out


def segments(positions: Sequence[int], shared_prefixes: Sequence) -> tuple[list[int], list[int], list[int]]:
    """Attention segments of a decode batch: (start offsets, rows, shared prefix length per segment).

    ``shared_prefixes``: the scheduler's ``SharedPrefix`` groups (``rows``, ``length``), as for ``decode``.

    A group of two or more rows with a shared prefix becomes segments of at most ``SEGMENT_ROWS``
    rows that read the prefix ``[0, P)`` once (P never covers a row's current token); every other
    row is a segment of its own with P = 0. Every row is in exactly one segment.
    """
    seen = [False] * len(positions)
    starts, rows, prefixes = [0], [], []
    for g in shared_prefixes:
        length = min([g.length, *(positions[r] for r in g.rows)])
        if len(g.rows) < 2 or length <= 0:
            continue
        for i in range(0, len(g.rows), SEGMENT_ROWS):
            chunk = g.rows[i : i + SEGMENT_ROWS]
            rows += chunk
            starts.append(len(rows))
            prefixes.append(length if len(chunk) > 1 else 0)
            for r in chunk:
                seen[r] = True
    for r, done in enumerate(seen):
        if not done:
            rows.append(r)
            starts.append(len(rows))
            prefixes.append(0)
    return starts, rows, prefixes
