"""Loading under FSDP2 (``training/trainer/sharded_load.py``): each rank reads only its own shards, and the sharded
model holds exactly the weights and buffers of a whole load, on both paths (slices, and rank 0's broadcast)."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from training.utils import dist as D
    from training.trainer import sharded_load
    from training.trainer.distributed import full_tensor
    from training.trainer.model import load_causal_lm

    model_path, out = sys.argv[1], sys.argv[2]
    D.init_distributed("cpu")
    whole = load_causal_lm(model_path, "cpu", torch.float32)
    expected = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    read = []  # (name, rows) this rank read through the slicing path
    real_slice = sharded_load.shard_rows
    sharded_load.shard_rows = lambda total, local: read.append((total, local)) or real_slice(total, local)
    report = {}
    for path in ("slices", "broadcast"):
        if path == "broadcast":
            sharded_load.checkpoint_files = lambda *a, **k: None  # as for a GGUF file: rank 0 reads, all receive
        read.clear()
        model = sharded_load.load_sharded(model_path, "cpu", torch.float32)
        got = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        assert set(got) == set(expected), set(got) ^ set(expected)
        gap = max((full_tensor(got[n].detach()).float() - expected[n].detach().float()).abs().max().item() for n in got)
        local = sum(p.to_local().numel() for p in model.parameters())
        report[path] = {"gap": gap, "rows_read": sum(r for _, r in read), "rows_total": sum(t for t, _ in read),
                        "local": local, "whole": sum(p.numel() for p in whole.parameters())}
    with open(f"{out}.{D.rank()}", "w") as f:
        json.dump(report, f)
    D.shutdown_distributed()
""")


def test_each_rank_reads_its_own_shards_and_gets_the_whole_loads_weights(tiny_model_path, tmp_path):
    script = tmp_path / "load.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINING_DIST_TIMEOUT_S": "120", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(
        [*cmd, tiny_model_path, str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-6000:]
    reports = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    for report in reports:
        for path in ("slices", "broadcast"):
            assert report[path]["gap"] == 0.0, (path, report[path])
        slices = report["slices"]
        assert slices["rows_read"] * 2 <= slices["rows_total"] + len(reports) * 64, slices  # about half of every row
        assert slices["local"] * 2 <= slices["whole"] + 1024, slices  # its shard, not the model
    # the two ranks' rows add up to every row of every parameter, each read once
    assert sum(r["slices"]["rows_read"] for r in reports) == reports[0]["slices"]["rows_total"]
