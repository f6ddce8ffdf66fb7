"""The multi-node walkthrough (README "Multi-node", skills/multi-node) on one host, over loopback.

Two embedded servers run as processes of their own (``python -m training.deployment.serve``, as a
user starts them on the inference node); the trainer is two ``torchrun --nnodes 2`` launches (node
ranks 0 and 1, gloo, c10d rendezvous at 127.0.0.1), as on two training hosts; the run attaches to
both servers by ``base_url`` with ``weight_sync="distributed"``. It trains a few steps on the tiny
model on the servers' own token ids, and every server ends at the final weight version with the
weights of the exported final model.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
import torch

STEPS = 3

TRAIN_SCRIPT = textwrap.dedent('''
    """A user's train.py: nothing in it knows how many nodes it runs on."""
    import json, os, sys
    from training.recipes.async_rl_loop import Config, main
    from training.utils import DeployConfig, TrainerConfig
    from training.utils.rl.rollout import RolloutSample

    model_path, urls, log_path, steps, out = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4], sys.argv[5]
    ROWS = [{"id": i, "prompt_ids": [1, 10 + i % 50, 20 + i % 7, 201]} for i in range(32)]


    def make_rollout_fn(setup):
        sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)

        async def rollout_fn(row):
            (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
            n = len(c.full_tokens) - c.prompt_len
            return RolloutSample(tokens=list(c.full_tokens), logprobs=[0.0] * c.prompt_len + list(c.inference_logprobs),
                                 loss_mask=[0] * c.prompt_len + [1] * n, reward=float(c.full_tokens[-1] % 3),
                                 finish_reason=c.finish_reason)
        return rollout_fn


    # weight_sync_master_addr: THIS node's address (only the node that gets rank 0 uses it)
    deploy = DeployConfig(base_url=urls, weight_sync="distributed", weight_sync_master_addr=os.environ["NODE_ADDR"],
                          weight_sync_backend="gloo", weight_bucket_mb=0.05)
    cfg = Config(base_model=model_path, log_path=log_path, completions_per_prompt=2, prompt_groups_per_step=2,
                 max_tokens=4, max_steps=int(steps), synchronous_training=True, max_head_offpolicy_versions=0,
                 shuffle_rows=False, export_final_model=True,
                 trainer=TrainerConfig(learning_rate=1e-2, micro_batch_tokens=32, device="cpu"), deployment=deploy)
    result = main(cfg, rollout_fn_factory=make_rollout_fn, rows=ROWS)
    with open(os.path.join(out, f"result_{os.environ['RANK']}.json"), "w") as f:
        json.dump({"steps": result["steps"], "final_model": result["final_model"], "node": os.environ["NODE_RANK"]}, f)
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_path: str, log_path) -> tuple[subprocess.Popen, str]:
    """``python -m training.deployment.serve`` on a free port (the inference node's command)."""
    engine = {"model": model_path, "max_model_len": 256, "max_batch_size": 8, "device": "cpu", "dtype": "float32"}
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.deployment.serve", "--port", "0", "--engine-config", json.dumps(engine)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    for line in proc.stdout:  # the ready line names the bound port
        m = re.search(r"DEPLOYMENT READY (http://\S+)", line)
        if m:
            return proc, m.group(1)
    raise AssertionError(f"server exited before it was ready: {log_path.read_text()[-3000:]}")


def completion(url: str) -> dict:
    body = {"prompt": [1, 12, 23, 201], "max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({**body, "logprobs": 0, "return_token_ids": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]


@pytest.mark.slow
def test_two_trainer_nodes_sync_weights_to_two_servers_over_loopback(tiny_model_path, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    servers = []
    try:
        for i in range(2):
            servers.append(start_server(tiny_model_path, tmp_path / f"server{i}.log"))
        urls = ",".join(url for _, url in servers)
        rdzv = f"127.0.0.1:{free_port()}"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TRAINING_DIST_TIMEOUT_S": "120",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "NODE_ADDR": "127.0.0.1",
            "GLOO_SOCKET_IFNAME": "lo",
        }
        nodes = []
        for node_rank in range(2):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node_rank),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                rdzv,
                "--rdzv-id",
                "multi-node-test",
                str(script),
                tiny_model_path,
                urls,
                tmp_path / "run",
                STEPS,
                tmp_path,
            ]
            nodes.append(
                subprocess.Popen(
                    [str(a) for a in cmd],
                    cwd=tmp_path,
                    env={**env, "NODE_RANK": str(node_rank)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        deadline = time.monotonic() + 600
        outputs = []
        for p in nodes:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outputs.append(out)
        for p, out in zip(nodes, outputs):
            assert p.returncode == 0, out[-6000:]
        results = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(2)]
        assert [r["steps"] for r in results] == [STEPS, STEPS]
        assert {r["node"] for r in results} == {"0", "1"}  # one trainer rank per node
        final_dir = results[0]["final_model"]
        choices = [completion(url) for _, url in servers]
    finally:
        for proc, _ in servers:
            proc.terminate()
        for proc, _ in servers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32).eval()
    prompt = [1, 12, 23, 201]
    for ch in choices:
        assert ch["weight_version"] == STEPS  # every server ends at the final weight version
        ids = torch.tensor([prompt + ch["token_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(final(ids).logits[0], dim=-1)[len(prompt) - 1 : -1]
        ref = logp.gather(1, torch.tensor(ch["token_ids"])[:, None])[:, 0]
        assert (ref - torch.tensor(ch["logprobs"]["token_logprobs"])).abs().max().item() < 1e-5
