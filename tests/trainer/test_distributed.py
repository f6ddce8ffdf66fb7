"""The trainer under ``torchrun --nproc-per-node 2`` (FSDP2 on CPU, gloo) against one process.

Children run with ``OMP_NUM_THREADS=1``; the scripts are written into ``tmp_path`` the way a
user's ``train.py`` would look (no torchrun-specific code in the recipe script).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from training.utils import TrainerConfig

UNIT_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from training.trainer import PolicyTrainer
    from training.utils import dist as D
    from training.utils import TrainerConfig
    from training.utils.checkpoint import save_checkpoint
    from training.utils.rl.ppo import StepBatch

    model_path, out = sys.argv[1], Path(sys.argv[2])
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"  # "cuda": NCCL, one GPU per rank
    D.init_distributed(device)
    r = D.rank()
    # 1. a step's batch reaches every rank intact (rank 0 holds it, the others pass None)
    batch = StepBatch(tokens=[[1, 2, 3], [4, 5], [6, 7, 8, 9]], sampler_logprobs=[[0.0, -0.5, -1.25], [0.0, -1 / 3],
                      [0.0, 0.0, -2.0e-7, -7.5]], loss_masks=[[0, 1, 1], [0, 1], [0, 0, 1, 1]],
                      advantages=[0.7071067811865476, [0.0, -1 / 3], 1e-300], weights=[1.0, 0.5, 2.0])
    got = StepBatch.broadcast(batch if r == 0 else None)
    # 2. metrics combine over ranks: weighted mean, max, min, sum
    metrics = D.reduce_metrics({"a": float(r + 1), "b_max": float(r), "c_min": float(r), "loss": 1.0,
                                **({"only_rank1": 5.0} if r == 1 else {})}, weight=float(r + 1), sum_keys=("loss",))
    (out / f"unit_{r}.json").write_text(json.dumps({"batch": got.__dict__, "metrics": metrics}))
    # 3. one FSDP step; the full state before saving; a sharded DCP checkpoint
    t = PolicyTrainer(model_path, TrainerConfig(learning_rate=1e-2, micro_batch_tokens=8, device=device))
    seqs = [[1, 5 + i, 7, 9 + i, 11, 13][: 2 + i % 5] for i in range(7)]
    total = sum(len(s) for s in seqs)
    lp = t.logprobs(seqs)
    m = t.forward_backward(seqs, lambda packed, lp_N: (-lp_N.sum() / total, {"lp_mean": float(lp_N.detach().mean())}))
    o = t.optim_step()
    model_sd, optim_sd = get_state_dict(t.model, t.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if r != 0:  # what RunContext.follow does: rank 0's named_weights announces the pass
        assert D.receive_command()[0] == D.Command.WEIGHTS
    weights = {name: w.clone() for name, w in t.named_weights()}  # every rank iterates; rank 0 keeps
    # a consumer on rank 0 that stops after one tensor still leaves the ranks in step
    if r == 0:
        early = t.named_weights()
        next(early)
        early.close()
    else:
        assert D.receive_command()[0] == D.Command.WEIGHTS
        assert len(list(t.named_weights())) == len(weights)
    assert D.max_over_ranks(r + 1) == 2
    if r == 0:
        torch.save({"model": model_sd, "optim": optim_sd, "logprobs": lp, "metrics": m, "optim_step": o,
                    "named_weights": weights}, out / "expected.pt")
    save_checkpoint(out / "ckpt", 1, t.model, t.optimizer, {"step": 1} if r == 0 else None)
    D.shutdown_distributed()
""")

RECIPE_SCRIPT = textwrap.dedent('''
    """A user's train.py: nothing in it knows about torchrun."""
    import json, os, sys
    from training.recipes.async_rl_loop import Config, main
    from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
    from training.utils.rl.rollout import RolloutSample

    model_path, base_url, log_path, max_steps, out = sys.argv[1:6]
    FAIL = "fail" in sys.argv[6:]
    # "dist-sync": weights reach the server over a torch.distributed group of their own
    DEPLOY = (DeployConfig(base_url=base_url, weight_sync="distributed", weight_sync_master_addr="127.0.0.1")
              if "dist-sync" in sys.argv[6:] else DeployConfig(base_url=base_url))
    ROWS = [{"id": i, "prompt_ids": [1, 10 + i % 50, 20 + i % 7, 201]} for i in range(32)]


    def make_rollout_fn(setup):
        """Asks the real server for one token (weight version), then returns a sample fixed by (row, k)."""
        sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)
        calls = {}

        async def rollout_fn(row):
            k = calls[row["id"]] = calls.get(row["id"], -1) + 1
            if FAIL:
                raise RuntimeError("scripted rollout failure")
            (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
            n = 2 + (row["id"] + 3 * k) % 5
            completion = [30 + (row["id"] * 7 + k * 3 + j * 5) % 60 for j in range(n)]
            prompt = row["prompt_ids"]
            return RolloutSample(tokens=prompt + completion, logprobs=[0.0] * len(prompt) + [-3.0 - 0.1 * j for j in range(n)],
                                 loss_mask=[0] * len(prompt) + [1] * n, reward=float((row["id"] + k) % 3),
                                 text=str(c.weight_version))
        return rollout_fn


    cfg = Config(base_model=model_path, log_path=log_path, completions_per_prompt=2, prompt_groups_per_step=2,
                 max_tokens=1, max_steps=int(max_steps), synchronous_training=True, max_head_offpolicy_versions=0,
                 shuffle_rows=False, ppo_mini_batches=2, dcp_save_interval=2, export_final_model=True,
                 trainer=TrainerConfig(learning_rate=1e-2, micro_batch_tokens=16, device="cpu"),
                 loss=LossConfig(kl_beta=0.05), deployment=DEPLOY)
    result = main(cfg, rollout_fn_factory=make_rollout_fn, rows=ROWS)
    with open(os.path.join(out, f"result_{os.environ.get('RANK', 'single')}.json"), "w") as f:
        json.dump({"steps": result["steps"], "final_model": result["final_model"]}, f)
''')


def _run(args, tmp_path, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINING_DIST_TIMEOUT_S": "120", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    done = subprocess.run(
        [str(a) for a in args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        (tmp_path / "stderr.txt").write_text(done.stderr)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-8000:])
    return done


def _torchrun(script, *args):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        *map(str, args),
    ]


def test_split_for_ranks_balances_tokens_and_covers_every_sequence():
    from training.trainer.distributed import split_for_ranks

    shares = split_for_ranks([10, 1, 1, 1, 7, 3], 2)
    assert sorted(i for s in shares for i in s) == list(range(6))
    assert shares == [[0, 1, 3], [2, 4, 5]]  # longest first to the lighter rank: 12 vs 11 tokens
    assert split_for_ranks([5], 3) == [[0], [], []]


def test_single_process_is_untouched():
    from training.utils import dist as D

    assert not D.is_distributed() and D.is_main_rank() and D.world_size() == 1
    assert D.init_distributed("cpu") is False  # no WORLD_SIZE: nothing starts
    assert D.reduce_metrics({"a": 1.0}, 3.0) == {"a": 1.0}
    with D.lead(D.Command.TRAIN):
        pass
    D.stop_followers()


def test_two_rank_step_matches_one_process_and_its_checkpoint_loads_in_one(tiny_model_path, tmp_path):
    """Batch broadcast is exact; an FSDP step on 2 ranks gives the one-process logprobs, loss, grad norm
    and weights; its 2-rank DCP checkpoint loads into a plain model with exactly the saved state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from training.trainer import PolicyTrainer
    from training.utils.checkpoint import load_checkpoint

    script = tmp_path / "unit.py"
    script.write_text(UNIT_SCRIPT)
    _run(_torchrun(script, tiny_model_path, tmp_path), tmp_path)

    sent = {
        "tokens": [[1, 2, 3], [4, 5], [6, 7, 8, 9]],
        "sampler_logprobs": [[0.0, -0.5, -1.25], [0.0, -1 / 3], [0.0, 0.0, -2.0e-7, -7.5]],
        "loss_masks": [[0, 1, 1], [0, 1], [0, 0, 1, 1]],
        "advantages": [0.7071067811865476, [0.0, -1 / 3], 1e-300],  # a scalar stays one, a per-token list a list
        "weights": [1.0, 0.5, 2.0],
    }
    for r in (0, 1):
        unit = json.loads((tmp_path / f"unit_{r}.json").read_text())
        assert unit["batch"] == sent  # bit-exact floats on both ranks
        assert unit["metrics"] == {"a": (1 * 1 + 2 * 2) / 3, "b_max": 1.0, "c_min": 0.0, "loss": 2.0, "only_rank1": 5.0}

    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    # the same step in one process, from the same starting weights
    cfg = TrainerConfig(learning_rate=1e-2, micro_batch_tokens=8, device="cpu")
    one = PolicyTrainer(tiny_model_path, cfg)
    seqs = [[1, 5 + i, 7, 9 + i, 11, 13][: 2 + i % 5] for i in range(7)]
    total = sum(len(s) for s in seqs)
    lp = one.logprobs(seqs)
    assert max(abs(a - b) for x, y in zip(lp, expected["logprobs"]) for a, b in zip(x, y)) < 1e-5
    m = one.forward_backward(seqs, lambda packed, lp_N: (-lp_N.sum() / total, {"lp_mean": float(lp_N.detach().mean())}))
    assert m["loss"] == pytest.approx(expected["metrics"]["loss"], rel=1e-5)
    assert m["lp_mean"] == pytest.approx(expected["metrics"]["lp_mean"], rel=1e-5)
    assert one.optim_step()["grad_norm"] == pytest.approx(expected["optim_step"]["grad_norm"], rel=1e-5)
    for name, w in one.named_weights():
        assert torch.allclose(w, expected["named_weights"][name], atol=1e-4), name
    assert set(dict(one.named_weights())) == set(expected["named_weights"])  # tied lm_head left out on both

    # the 2-rank checkpoint, loaded by one process: exactly the state gathered before saving
    fresh = PolicyTrainer(tiny_model_path, cfg)
    assert load_checkpoint(tmp_path / "ckpt" / "step_000001", fresh.model, fresh.optimizer) == {"step": 1}
    model_sd, optim_sd = get_state_dict(fresh.model, fresh.optimizer)
    assert set(model_sd) == set(expected["model"])
    for k, v in expected["model"].items():
        assert torch.equal(model_sd[k], v), k
    assert set(optim_sd["state"]) == set(expected["optim"]["state"])
    for fqn, state in expected["optim"]["state"].items():
        for key, value in state.items():
            assert torch.equal(optim_sd["state"][fqn][key], value), (fqn, key)
    assert [g["lr"] for g in optim_sd["param_groups"]] == [g["lr"] for g in expected["optim"]["param_groups"]]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL with 2 ranks needs 2 CUDA GPUs")
def test_two_ranks_on_nccl_broadcast_exactly_and_checkpoint_for_one(tiny_model_path, tmp_path):
    """The same script on GPUs (cpu:gloo,cuda:nccl): the batch arrives intact, and the 2-rank checkpoint
    loads into one CPU process with exactly the state gathered before saving. By hand:
    ``torchrun --nproc-per-node 2 unit.py MODEL OUT cuda`` (the script is ``UNIT_SCRIPT``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from training.trainer import PolicyTrainer
    from training.utils.checkpoint import load_checkpoint

    script = tmp_path / "unit.py"
    script.write_text(UNIT_SCRIPT)
    _run(_torchrun(script, tiny_model_path, tmp_path, "cuda"), tmp_path)
    units = [json.loads((tmp_path / f"unit_{r}.json").read_text()) for r in (0, 1)]
    assert units[0]["batch"] == units[1]["batch"] and units[0]["batch"]["weights"] == [1.0, 0.5, 2.0]
    expected = torch.load(tmp_path / "expected.pt", weights_only=True, map_location="cpu")
    fresh = PolicyTrainer(tiny_model_path, TrainerConfig(learning_rate=1e-2, micro_batch_tokens=8, device="cpu"))
    assert load_checkpoint(tmp_path / "ckpt" / "step_000001", fresh.model, fresh.optimizer) == {"step": 1}
    model_sd, _ = get_state_dict(fresh.model, fresh.optimizer)
    for k, v in expected["model"].items():
        assert torch.equal(model_sd[k], v), k


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(fresh=True, max_batch_size=16)  # the recipes push their weights to it


def _losses(log_path):
    from training.utils.metrics import read_metrics

    rows = [r for r in read_metrics(log_path) if "train/loss" in r]
    return [r["step"] for r in rows], [r["train/loss"] for r in rows], [r["train/grad_norm"] for r in rows]


@pytest.mark.slow
def test_async_rl_loop_on_two_ranks_matches_one_process_and_resumes_on_one(tiny_model_path, server, tmp_path):
    """async_rl_loop under torchrun (2 ranks, FSDP2, kl_beta > 0, 2 mini-batches, several micro-batches)
    gives the one-process loss curve; its checkpoint then resumes in one process at the next step."""
    script = tmp_path / "train.py"
    script.write_text(RECIPE_SCRIPT)
    single, multi = tmp_path / "single", tmp_path / "multi"
    single.mkdir()
    multi.mkdir()
    _run([sys.executable, str(script), tiny_model_path, server.base_url, single / "run", 4, single], tmp_path)
    _run(_torchrun(script, tiny_model_path, server.base_url, multi / "run", 3, multi), tmp_path)

    results = [json.loads((multi / f"result_{r}.json").read_text()) for r in (0, 1)]
    assert [r["steps"] for r in results] == [3, 3]  # rank 1 followed all three steps
    assert results[0]["final_model"] and results[1]["final_model"] is None
    assert (multi / "run" / "final" / "model.safetensors").exists()
    assert sorted(p.name for p in (multi / "run" / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
    assert len(list((multi / "run" / "checkpoints" / "step_000003").glob("*.distcp"))) == 2  # one shard per rank
    steps, _, _ = _losses(multi / "run")
    assert steps == [0, 1, 2]  # rank 0 alone writes metrics: no duplicated step
    assert not (multi / "run" / "deployment.log").exists()

    # the 2-rank checkpoint of step 3, resumed by one process: it runs step 3 only
    done = _run([sys.executable, str(script), tiny_model_path, server.base_url, multi / "run", 4, multi], tmp_path)
    assert "resumed from" in done.stderr
    steps_1, loss_1, grad_1 = _losses(single / "run")
    steps_2, loss_2, grad_2 = _losses(multi / "run")
    assert steps_1 == steps_2 == [0, 1, 2, 3]
    diffs = [abs(a - b) for a, b in zip(loss_1 + grad_1, loss_2 + grad_2)]
    print("loss 1 rank:", loss_1, "\nloss 2 ranks:", loss_2, "\nmax |diff| loss/grad-norm:", max(diffs))
    assert all(abs(a) > 1e-4 for a in loss_1)  # a curve that could differ
    for a, b in zip(loss_1, loss_2):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    for a, b in zip(grad_1, grad_2):
        assert a == pytest.approx(b, rel=1e-4)


@pytest.mark.slow
def test_followers_exit_cleanly_when_rank_0_fails(tiny_model_path, server, tmp_path):
    """Rank 0 stops on a rollout failure; it releases rank 1, which returns normally (no hang)."""
    script = tmp_path / "train.py"
    script.write_text(RECIPE_SCRIPT)
    args = _torchrun(script, tiny_model_path, server.base_url, tmp_path / "run", 3, tmp_path, "fail")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINING_DIST_TIMEOUT_S": "120"}
    done = subprocess.run([str(a) for a in args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "RolloutFailureError" in done.stderr
    assert json.loads((tmp_path / "result_1.json").read_text())["steps"] == 0  # rank 1 was sent STOP
    assert not (tmp_path / "result_0.json").exists()


@pytest.mark.slow
def test_two_ranks_stream_weights_to_a_server_over_their_own_group(embedded_server, tiny_model_path, tmp_path):
    """weight_sync="distributed" under torchrun: FSDP2 gathers each tensor as it is broadcast; the
    server ends on the last version with exactly the weights of the exported final model."""
    import urllib.request

    from transformers import AutoModelForCausalLM

    script = tmp_path / "train.py"
    script.write_text(RECIPE_SCRIPT)
    with embedded_server(fresh=True, max_batch_size=8) as dep:  # fresh: it joins a group and takes pushes
        _run(_torchrun(script, tiny_model_path, dep.base_url, tmp_path / "run", 2, tmp_path, "dist-sync"), tmp_path)
        prompt = [1, 12, 23, 201]
        body = json.dumps(
            {
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 1.0,
                "seed": 5,
                "ignore_eos": True,
                "logprobs": 0,
                "return_token_ids": True,
            }
        ).encode()
        req = urllib.request.Request(
            dep.base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            choice = json.loads(resp.read())["choices"][0]
    assert choice["weight_version"] == 2
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final", dtype=torch.float32).eval()
    ids = torch.tensor([prompt + choice["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(final(ids).logits[0], dim=-1)[len(prompt) - 1 : -1]
    ref = logp.gather(1, torch.tensor(choice["token_ids"])[:, None])[:, 0]
    assert (ref - torch.tensor(choice["logprobs"]["token_logprobs"])).abs().max().item() < 1e-5


LORA_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from training.trainer import PolicyTrainer
    from training.utils import dist as D
    from training.utils import TrainerConfig
    from training.utils.checkpoint import save_checkpoint

    model_path, out = sys.argv[1], Path(sys.argv[2])
    D.init_distributed("cpu")
    r = D.rank()
    cfg = TrainerConfig(learning_rate=1e-2, micro_batch_tokens=40, device="cpu", lora_rank=4, lora_alpha=8.0)
    t = PolicyTrainer(model_path, cfg)
    seqs = [[1, 2, 3, 4, 5, 6, 7][: 4 + g] + [20 + g + 3 * k + j for j in range(1 + (g + k) % 4)]
            for g in range(3) for k in range(4)]
    total = sum(len(s) for s in seqs)
    assert t.share_prefixes
    lp = t.logprobs(seqs)
    ref = t.base_reference().logprobs(seqs)
    m = t.forward_backward(seqs, lambda packed, lp_N: (-lp_N.sum() / total, {}))
    o = t.optim_step()
    if r != 0:
        assert D.receive_command()[0] == D.Command.WEIGHTS
    weights = {name: w.clone() for name, w in t.named_weights()}
    if r == 0:
        torch.save({"logprobs": lp, "ref": ref, "loss": m["loss"], "grad_norm": o["grad_norm"],
                    "named_weights": weights, "specs": t.weight_specs()}, out / "lora_expected.pt")
    save_checkpoint(out / "ckpt", 1, t.model, t.optimizer, {"step": 1} if r == 0 else None)
    if r != 0:
        assert D.receive_command()[0] == D.Command.EXPORT
    t.save_pretrained(out / "export")
    D.shutdown_distributed()
""")


def test_lora_with_shared_prompts_on_two_ranks_matches_one_process(tiny_model_path, tmp_path):
    """FSDP2 with LoRA adapters and shared-prompt packing (groups kept whole per rank): the same logprobs,
    reference logprobs, loss, grad norm and merged weights as one process; the checkpoint (adapters and
    their optimizer state) resumes in one process, and the export is the merged model."""
    pytest.importorskip("peft", reason="LoRA needs the 'lora' extra (scripts/setup.sh installs it)")
    from training.trainer import PolicyTrainer
    from training.utils.checkpoint import load_checkpoint

    script = tmp_path / "lora.py"
    script.write_text(LORA_SCRIPT)
    _run(_torchrun(script, tiny_model_path, tmp_path), tmp_path)
    expected = torch.load(tmp_path / "lora_expected.pt", weights_only=True)

    cfg = TrainerConfig(learning_rate=1e-2, micro_batch_tokens=40, device="cpu", lora_rank=4, lora_alpha=8.0)
    one = PolicyTrainer(tiny_model_path, cfg)
    seqs = [
        [1, 2, 3, 4, 5, 6, 7][: 4 + g] + [20 + g + 3 * k + j for j in range(1 + (g + k) % 4)]
        for g in range(3)
        for k in range(4)
    ]
    total = sum(len(s) for s in seqs)
    for got, want in (
        (one.logprobs(seqs), expected["logprobs"]),
        (one.base_reference().logprobs(seqs), expected["ref"]),
    ):
        assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) < 1e-5
    assert one.forward_backward(seqs, lambda packed, lp_N: (-lp_N.sum() / total, {}))["loss"] == pytest.approx(
        expected["loss"], rel=1e-5
    )
    assert one.optim_step()["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    weights = dict(one.named_weights())
    assert set(weights) == set(expected["named_weights"]) and one.weight_specs() == expected["specs"]
    for name, w in weights.items():
        assert torch.allclose(w, expected["named_weights"][name], atol=1e-5), name

    fresh = PolicyTrainer(tiny_model_path, TrainerConfig(**{**cfg.__dict__, "seed": 3}))
    assert load_checkpoint(tmp_path / "ckpt" / "step_000001", fresh.model, fresh.optimizer) == {"step": 1}
    for name, w in fresh.named_weights():
        assert torch.equal(w, expected["named_weights"][name]), name
    exported = PolicyTrainer(str(tmp_path / "export"), TrainerConfig(device="cpu"))
    for name, w in exported.named_weights():
        assert torch.equal(w, expected["named_weights"][name]), name
