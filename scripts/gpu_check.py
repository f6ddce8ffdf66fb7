"""The steps of ``scripts/gpu_check.sh``: one function per step, each printing Markdown for gpu_report.md.

    python scripts/gpu_check.py STEP        # one step (the shell script runs each under its time budget)

A step that cannot run says why in its output and exits 0 with a ``skipped:`` line; a step that runs and finds a
problem prints ``FAILED:`` with the reason and exits 1. Everything runs on the tiny models built locally or on
random-weight models of real shapes (no download).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def skipped(why: str) -> None:
    print(f"skipped: {why}")
    raise SystemExit(0)


def need_cuda():
    import torch

    if not torch.cuda.is_available():
        skipped(f"no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda})")
    return torch


def step_versions() -> None:
    import importlib.metadata as md
    import platform

    import torch

    print("```")
    print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA build {torch.version.cuda}")
    print(f"cuda available {torch.cuda.is_available()}, GPUs {torch.cuda.device_count()}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
    if torch.cuda.is_available():
        print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, cuDNN {torch.backends.cudnn.version()}")
    for name in ("transformers", "vllm", "sglang", "flash_attn"):
        try:
            print(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            print(f"{name}: not installed")
    print("```")


def step_engine_devices() -> None:
    """The embedded server started with device auto, cuda and cuda:0: health, one completion, the device it used."""
    need_cuda()
    from training.deployment.backends.embedded import EmbeddedDeployment
    from training.deployment.client import DeploymentSampler
    from training.models.build_tiny import ensure_tiny_model
    from training.utils import DeployConfig, EngineConfig

    import asyncio

    model = ensure_tiny_model("qwen3")
    failed = []
    print("| device | health | completion | stats device | seconds |\n| --- | --- | --- | --- | --- |")
    for device in ("auto", "cuda", "cuda:0"):
        start = time.time()
        cfg = DeployConfig(startup_timeout_s=120, engine_config=EngineConfig(device=device, max_batch_size=8))
        try:
            with EmbeddedDeployment(model, cfg) as dep:
                sampler = DeploymentSampler([dep.base_url], cfg)
                (c,) = asyncio.run(asyncio.wait_for(sampler.sample_with_prompt_tokens([1, 5, 7], n=1), 60))
                import urllib.request

                stats = json.loads(urllib.request.urlopen(dep.base_url + "/stats", timeout=10).read())
                where = stats.get("device") or stats.get("execution_path", "?")
                print(
                    f"| `{device}` | ok | {len(c.full_tokens) - c.prompt_len} tokens | {where} | {time.time() - start:.0f} |"
                )
        except Exception as exc:
            failed.append(device)
            print(f"| `{device}` | FAILED | {type(exc).__name__}: {str(exc)[:120]} | | {time.time() - start:.0f} |")
    if failed:
        print(f"FAILED: the server did not serve with device {', '.join(failed)}")
        raise SystemExit(1)


def step_sdpa_backends() -> None:
    """Which fused SDPA kernel each attention call of the trainer gets on CUDA (math excluded: an error means the
    call needs the math kernel)."""
    torch = need_cuda()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from training.trainer.model import attend

    q = torch.randn(1, 16, 512, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 4, 512, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(512, 512, device="cuda", dtype=torch.bool).tril()
    calls = {  # name -> (call, must a fused kernel take it?)
        "packed span (causal, GQA, bf16)": (lambda: attend(q, kv, kv), True),
        "shared-prefix suffix (mask, GQA, bf16)": (lambda: attend(q, kv, kv, mask=mask), True),
        "packed span (causal, GQA, fp32)": (lambda: attend(q.float(), kv.float(), kv.float()), True),
        "raw SDPA, mask + enable_gqa (what attend avoids)": (
            lambda: torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True),
            False,
        ),
    }
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    print("| call | " + " | ".join(backends) + " |\n| --- |" + " --- |" * len(backends))
    bad = []
    for name, (call, must) in calls.items():
        cells = []
        for backend in backends.values():
            try:
                with sdpa_kernel([backend]):
                    call()
                cells.append("yes")
            except RuntimeError:
                cells.append("no")
        if must and "yes" not in cells:
            bad.append(name)
        print(f"| {name} | " + " | ".join(cells) + " |")
    if bad:
        print(f"FAILED: only the math kernel takes {bad}")
        raise SystemExit(1)


def step_pytest_gpu() -> None:
    need_cuda()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "--timeout", "300"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print("```")
    print("\n".join(done.stdout.strip().splitlines()[-30:]))
    print("```")
    if done.returncode != 0:
        print(f"FAILED: pytest -m gpu exited {done.returncode}")
        raise SystemExit(1)


def step_colocated_recipe() -> None:
    """3 steps of async_rl_loop with the trainer and the embedded server colocated on cuda:0 (sleep / wake)."""
    need_cuda()
    from tests.recipes.test_recipes import ROWS, Recorder
    from tests.recipes.test_recipes import config as recipe_config
    from training.models.build_tiny import ensure_tiny_model
    from training.recipes import async_rl_loop
    from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
    from training.utils.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        deployment = DeployConfig(colocate=True, engine_config=EngineConfig(max_batch_size=16, device="cuda:0"))
        cfg = recipe_config(
            ensure_tiny_model("qwen3"),
            None,
            Path(tmp),
            max_steps=3,
            deployment=deployment,
            trainer=TrainerConfig(learning_rate=1e-3, device="cuda:0"),
            loss=LossConfig(kl_beta=0.0),
        )
        start = time.time()
        out = async_rl_loop.main(cfg, rollout_fn_factory=Recorder(), rows=ROWS)
        rows = [r for r in read_metrics(cfg.log_path) if "train/loss" in r]
    keys = ["step", "offpolicy/weight_version", "perf/gpu_memory_peak_gb"]
    keys += sorted({k for r in rows for k in r if k.startswith(("colocate/", "perf/weight_sync"))})
    print("| " + " | ".join(keys) + " |\n|" + " --- |" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    print(f"\n{out['steps']} steps in {time.time() - start:.0f} s")
    versions = [r["offpolicy/weight_version"] for r in rows]
    if out["steps"] != 3 or versions != sorted(versions) or versions[-1] <= versions[0]:
        print(f"FAILED: steps {out['steps']}, weight versions {versions}")
        raise SystemExit(1)


def _random_model(folder: Path, **shape) -> str:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from training.models.build_tiny import ensure_tiny_model

    config = Qwen2Config(**shape)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tiny = Path(ensure_tiny_model("qwen3"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny / name).read_bytes())
    return str(folder)


QWEN_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)


def step_graph_vs_eager() -> None:
    """bf16 decode on a Qwen2.5-1.5B-shaped random model: tokens/s with CUDA graphs and eager, in process."""
    torch = need_cuda()
    import asyncio

    from training.deployment.engine import AsyncEngine, EngineConfig, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = _random_model(Path(tmp), **QWEN_1_5B)
        print("| mode | batch | new tokens | tok/s | peak GB |\n| --- | --- | --- | --- | --- |")
        for graphs in (True, False):
            sizes = (1, 2, 4, 8, 16, 32, 64) if graphs else ()
            cfg = EngineConfig(
                model=path, device="cuda:0", dtype="bfloat16", max_batch_size=64, cuda_graph_batch_sizes=sizes
            )
            torch.cuda.reset_peak_memory_stats()

            async def run(cfg: EngineConfig):
                engine = AsyncEngine(cfg)
                await engine.start()
                params = SamplingParams(max_tokens=128, temperature=1.0, seed=1, ignore_eos=True)
                await engine.generate([1, 2, 3], params)  # warm-up (and capture)
                start = time.time()
                outs = await asyncio.gather(*(engine.generate([1, 2, 3 + i], params) for i in range(64)))
                seconds = time.time() - start
                await engine.shutdown()
                return sum(len(o.output_token_ids) for o in outs), seconds

            tokens, seconds = asyncio.run(run(cfg))
            peak = torch.cuda.max_memory_allocated() / 1e9
            print(f"| {'graphs' if graphs else 'eager'} | 64 | {tokens} | {tokens / seconds:.0f} | {peak:.1f} |")


def step_trainer_memory() -> None:
    """Trainer peak GPU memory for one step on a 1.5B-shaped model: packing and checkpointing on and off."""
    torch = need_cuda()
    from training.trainer import PolicyTrainer
    from training.utils import TrainerConfig

    with tempfile.TemporaryDirectory() as tmp:
        path = _random_model(Path(tmp), **QWEN_1_5B)
        seqs = [[5 + (i * 7 + j) % 1000 for j in range(256 + 128 * (i % 4))] for i in range(16)]
        seqs = [seqs[i // 4 * 4][:200] + s[200:] for i, s in enumerate(seqs)]  # groups of 4 sharing a prompt
        print("| shared-prompt packing | checkpointing | peak GB | step s |\n| --- | --- | --- | --- |")
        for share in (True, False):
            for checkpointing in (False, True):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                cfg = TrainerConfig(
                    device="cuda:0",
                    micro_batch_tokens=4096,
                    shared_prompt_packing=share,
                    gradient_checkpointing=checkpointing,
                )
                trainer = PolicyTrainer(path, cfg)
                start = time.time()
                trainer.forward_backward(seqs, lambda packed, lp: (-lp.sum() / 1e4, {}))
                trainer.optim_step()
                torch.cuda.synchronize()
                print(
                    f"| {share} | {checkpointing} | {torch.cuda.max_memory_allocated() / 1e9:.1f} | {time.time() - start:.1f} |"
                )
                del trainer


def step_vllm_push() -> None:
    """vLLM (CUDA build) as the deployment with the distributed weight push, when vLLM is installed here."""
    need_cuda()
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        skipped("vLLM is not installed in this interpreter (pip install vllm: its CUDA build pins its own torch)")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "-k", "vllm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print("```\n" + "\n".join(done.stdout.strip().splitlines()[-15:]) + "\n```")
    if done.returncode not in (0, 5):
        raise SystemExit(1)


STEPS = {
    "versions": step_versions,
    "engine_devices": step_engine_devices,
    "sdpa_backends": step_sdpa_backends,
    "pytest_gpu": step_pytest_gpu,
    "colocated_recipe": step_colocated_recipe,
    "graph_vs_eager": step_graph_vs_eager,
    "trainer_memory": step_trainer_memory,
    "vllm_push": step_vllm_push,
}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in STEPS:
        raise SystemExit(f"usage: python scripts/gpu_check.py {{{'|'.join(STEPS)}}}")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    STEPS[sys.argv[1]]()
