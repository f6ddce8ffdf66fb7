"""Peak resident memory of each rank while the trainer loads a model under torchrun (FSDP2, gloo, CPU).

    python -m benchmarks.trainer_load_memory [--model smollm2|tiny] [--ranks 2]

Runs ``torchrun --nproc-per-node RANKS`` twice on the same model: once loading the whole model on every
rank and then sharding it (``load_causal_lm`` + ``shard_model``), once through ``sharded_load.load_sharded``
(each rank reads only its shards). Each rank reports the growth of its peak resident memory over what it
held before the load (``ru_maxrss``), beside the model's fp32 bytes and one rank's share of them. Prints
one JSON line. Not in ``run_all`` (a one-off figure for the trainer README).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import json, resource, sys
    import torch
    from training.utils import dist as D
    from training.trainer.model import load_causal_lm
    from training.trainer.distributed import shard_model
    from training.trainer.sharded_load import load_sharded

    model_path, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
    D.init_distributed("cpu")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if mode == "whole":
        model = shard_model(load_causal_lm(model_path, "cpu", torch.float32), torch.device("cpu"))
    else:
        model = load_sharded(model_path, "cpu", torch.float32)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    with open(f"{out}.{D.rank()}", "w") as f:
        json.dump({"peak_growth_bytes": peak - before, "local_param_bytes": local}, f)
    D.shutdown_distributed()
""")


def model_path(name: str) -> str:
    if name == "smollm2":
        from training.models.smollm2 import ensure_smollm2

        return ensure_smollm2()
    from training.models.build_tiny import ensure_tiny_model

    return ensure_tiny_model("qwen3")


def run(path: str, mode: str, ranks: int, folder: Path) -> list[dict]:
    script = folder / "load.py"
    script.write_text(CHILD)
    out = folder / mode
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        str(script),
        path,
        mode,
        str(out),
    ]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=1800)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    path = model_path(args.model)
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        fp32_bytes = 4 * sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    with tempfile.TemporaryDirectory() as tmp:
        whole = run(path, "whole", args.ranks, Path(tmp))
        sharded = run(path, "sharded", args.ranks, Path(tmp))
    mb = 2**20
    print(
        json.dumps(
            {
                "figure": "trainer_load_memory",
                "model": args.model,
                "ranks": args.ranks,
                "model_fp32_mb": round(fp32_bytes / mb, 1),
                "local_shard_mb": [round(r["local_param_bytes"] / mb, 1) for r in sharded],
                "whole_then_shard_peak_growth_mb": [round(r["peak_growth_bytes"] / mb, 1) for r in whole],
                "sharded_load_peak_growth_mb": [round(r["peak_growth_bytes"] / mb, 1) for r in sharded],
            }
        )
    )


if __name__ == "__main__":
    main()
