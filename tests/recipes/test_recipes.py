"""Both recipes end to end on the tiny model against the real embedded server.

One server is started for the module (as a user attaching to an external deployment would);
each run pushes its own initial weights, so runs do not leak into each other.
"""

import asyncio
import json
import random

import aiohttp
import pytest
import torch

from training.recipes import async_rl_loop, rl_loop
from training.recipes import context as recipes_context
from training.recipes.context import RolloutFailureError
from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
from training.utils.http import auth_headers
from training.utils.metrics import read_metrics
from training.utils.rl.losses import LOSSES
from training.utils.rl.rollout import RolloutSample

ROWS = [{"id": i, "prompt_ids": [1, 10 + i % 50, 20 + i % 7, 201]} for i in range(64)]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(fresh=True, max_batch_size=32)  # the recipes push their weights to it


def config(tiny_model_path, server, tmp_path, **kw):
    """The small recipe config of these tests, on ``server`` unless ``deployment`` is given (then ``server`` may be None)."""
    base = dict(
        base_model=tiny_model_path,
        log_path=str(tmp_path / "run"),
        completions_per_prompt=2,
        prompt_groups_per_step=2,
        max_tokens=4,
        max_steps=2,
        export_final_model=False,
        trainer=TrainerConfig(learning_rate=1e-3),
        loss=LossConfig(kl_beta=0.0),
    )
    base.update(kw)
    if "deployment" not in kw:
        base["deployment"] = DeployConfig(base_url=server.base_url)
    return async_rl_loop.Config(**base)


class Recorder:
    """A rollout factory that records what happened; reward = share of even output ids."""

    def __init__(self, delay_for=None, fail_for=None, hang_for=None):
        self.rows, self.versions, self.outputs = [], [], []
        self.delay_for, self.fail_for, self.hang_for = delay_for or {}, fail_for or set(), hang_for or set()

    def __call__(self, setup):
        sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)

        async def rollout_fn(row):
            self.rows.append(row["id"])
            if row["id"] in self.fail_for:
                raise RuntimeError(f"scripted failure for row {row['id']}")
            if row["id"] in self.hang_for:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay_for.get(row["id"], 0.0))
            (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
            out = c.full_tokens[c.prompt_len :]
            self.outputs.append(out)
            self.versions.append(c.weight_version)
            versions = getattr(c, "token_weight_versions", None) or [c.weight_version] * len(out)
            return RolloutSample(
                tokens=c.full_tokens,
                logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
                loss_mask=[0] * c.prompt_len + [1] * len(out),
                reward=sum(t % 2 == 0 for t in out) / len(out) + random.random() * 1e-3,
                text=str(c.weight_version),
                token_weight_versions=versions,
            )

        return rollout_fn


def spy_training(monkeypatch, module):
    """Record (step version, [server weight_version of every trained sample]) per training step."""
    trained = []
    real = module.train_on_groups

    def spy(trainer, groups, *a, **kw):
        trained.append([int(s.text) for g in groups for s in g.samples])
        return real(trainer, groups, *a, **kw)

    monkeypatch.setattr(module, "train_on_groups", spy)
    return trained


def test_async_and_sync_recipes_run_and_log(tiny_model_path, server, tmp_path):
    for i, mod in enumerate((async_rl_loop, rl_loop)):
        cfg = config(tiny_model_path, server, tmp_path / str(i), max_head_offpolicy_versions=1)
        out = mod.main(cfg, rollout_fn_factory=Recorder(), rows=ROWS)
        assert out["steps"] == 2
        rows = read_metrics(cfg.log_path)
        assert [r["step"] for r in rows] == [0, 1]
        for key in (
            "rollout/reward_mean",
            "train/loss",
            "train/grad_norm",
            "perf/step_time_s",
            "perf/train_s",
            "perf/weight_sync_s",
            "perf/wait_rollout_s",
            "perf/trained_tokens_per_s",
            "perf/overlap_fraction",
            "offpolicy/staleness_mean",
            "train/mismatch_kl",
        ):
            assert key in rows[-1], key
        assert all(r["perf/server_rss_mb"] > 50 for r in rows)  # the embedded server's resident memory, every step
        assert all(r["perf/kv_blocks_used"] >= 0 and r["perf/kv_blocks_cached"] >= 0 for r in rows)
        trained = [json.loads(line) for line in (tmp_path / str(i) / "run" / "rollouts.jsonl").read_text().splitlines()]
        assert len(trained) == sum(r["rollout/samples"] for r in rows)
        assert {"step", "reward", "advantage", "submit_version", "text"} <= set(trained[0])


def trained_positions(log_path) -> dict[int, list[int]]:
    """Row position -> the steps whose batch trained it (from rollouts.jsonl, one line per sample)."""
    steps: dict[int, set] = {}
    for line in (log_path / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        steps.setdefault(r["row_position"], set()).add(r["step"])
    return {p: sorted(s) for p, s in steps.items()}


@pytest.mark.parametrize("O", [0, 1, 2])
def test_straggler_is_trained_within_the_bound_and_no_row_is_lost_or_trained_twice(
    tiny_model_path, server, tmp_path, monkeypatch, O
):
    trained = spy_training(monkeypatch, recipes_context)
    slow = {ROWS[1]["id"]: 3.0, ROWS[3]["id"]: 4.0}  # two groups lag several steps behind the others
    cfg = config(
        tiny_model_path,
        server,
        tmp_path,
        max_head_offpolicy_versions=O,
        max_steps=None,
        prompt_groups_per_step=1,
        shuffle_rows=False,
    )
    async_rl_loop.main(cfg, rollout_fn_factory=Recorder(delay_for=slow), rows=ROWS[:8])
    assert len(trained) == 8  # every row of the single pass, each in its own step
    for step, versions in enumerate(trained):
        # the server-reported version of every trained sample is within O of the step's weights
        assert all(step - v <= O for v in versions), (step, versions)
    metrics = read_metrics(cfg.log_path)
    assert max(r["offpolicy/staleness_max"] for r in metrics) <= O
    assert max(r["offpolicy/token_lag_max"] for r in metrics) <= O  # per token, from token_weight_versions
    assert sum(r["offpolicy/dropped_stale"] for r in metrics) == 0  # stale_policy="wait" is the default
    positions = trained_positions(tmp_path / "run")
    assert sorted(positions) == list(range(8)) and all(len(s) == 1 for s in positions.values())
    if O == 0:
        assert all(v == step for step, vs in enumerate(trained) for v in vs)
    assert all("offpolicy/trainer_wait_s" in r and "offpolicy/window_occupancy" in r for r in metrics)


def test_drop_policy_requeues_the_late_row_instead_of_losing_it(tiny_model_path, server, tmp_path, monkeypatch):
    deployed = [0]
    real_sync = recipes_context.RunContext.sync_weights

    async def spy_sync(self, version, **kw):
        deployed[0] = version
        return await real_sync(self, version, **kw)

    monkeypatch.setattr(recipes_context.RunContext, "sync_weights", spy_sync)
    late_calls = []

    def factory(setup):
        inner = Recorder()(setup)

        async def rollout_fn(row):
            if row["id"] == 1 and len(late_calls) < 2:  # the first submission of row 1 finishes after step 2
                late_calls.append(row["id"])
                while deployed[0] < 3:
                    await asyncio.sleep(0.02)
            return await inner(row)

        return rollout_fn

    cfg = config(
        tiny_model_path,
        server,
        tmp_path,
        max_head_offpolicy_versions=1,
        max_steps=None,
        prompt_groups_per_step=1,
        shuffle_rows=False,
        stale_policy="drop",
    )
    async_rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS[:6])
    metrics = read_metrics(cfg.log_path)
    assert sum(r["offpolicy/dropped_stale_groups"] for r in metrics if "train/loss" in r) == 1
    positions = trained_positions(tmp_path / "run")
    assert sorted(positions) == list(range(6)) and all(len(s) == 1 for s in positions.values())
    assert positions[1][0] >= 3  # trained after its requeue, not in its original place


def test_inflight_weight_updates_push_without_draining(tiny_model_path, server, tmp_path, monkeypatch):
    waits = []
    real = recipes_context.DeploymentGroup.push

    async def spy(self, named_weights, version, **kw):
        waits.append(kw.get("wait_for_inflight"))
        return await real(self, named_weights, version, **kw)

    monkeypatch.setattr(recipes_context.DeploymentGroup, "push", spy)
    for inflight in (False, True):
        waits.clear()
        cfg = config(
            tiny_model_path,
            server,
            tmp_path / str(inflight),
            max_head_offpolicy_versions=1,
            inflight_weight_updates=inflight,
        )
        assert async_rl_loop.main(cfg, rollout_fn_factory=Recorder(), rows=ROWS)["steps"] == 2
        assert waits and all(w is (not inflight) for w in waits), waits


def test_rl_loop_pushes_weights_every_weight_sync_interval_steps(tiny_model_path, server, tmp_path, monkeypatch):
    pushed = []
    real = recipes_context.RunContext.sync_weights

    async def spy(self, version, **kw):
        pushed.append(version)
        return await real(self, version, **kw)

    monkeypatch.setattr(recipes_context.RunContext, "sync_weights", spy)
    rec = Recorder()
    cfg = config(
        tiny_model_path,
        server,
        tmp_path,
        max_steps=5,
        weight_sync_interval=2,
        max_head_offpolicy_versions=1,
        prompt_groups_per_step=1,
    )
    rl_loop.main(cfg, rollout_fn_factory=rec, rows=ROWS)
    assert pushed == [0, 2, 4]  # the initial push to the attached server, then after steps 2 and 4
    # samples of step k were generated under the last pushed version: 0, 0, 2, 2, 4
    per_step = [r["offpolicy/weight_version"] for r in read_metrics(cfg.log_path) if "train/loss" in r]
    assert per_step == [0, 2, 2, 4, 4]
    assert [int(v) for v in rec.versions[::2]] == [0, 0, 2, 2, 4]


def test_eval_scores_the_weights_of_the_step_it_reports(tiny_model_path, server, tmp_path, monkeypatch):
    """With ``weight_sync_interval=2`` the final eval after step 3 still runs on version 3 (pushed for it)."""
    pushed = []
    real = recipes_context.RunContext.sync_weights

    async def spy(self, version, **kw):
        pushed.append(version)
        return await real(self, version, **kw)

    monkeypatch.setattr(recipes_context.RunContext, "sync_weights", spy)
    rec = Recorder()
    eval_rows = [dict(r, id=100 + i) for i, r in enumerate(ROWS[:2])]
    cfg = config(
        tiny_model_path,
        server,
        tmp_path,
        max_steps=3,
        weight_sync_interval=2,
        max_head_offpolicy_versions=1,
        prompt_groups_per_step=1,
        eval_rows=eval_rows,
        eval_interval=3,
    )
    eval_versions = []

    def factory(setup):
        rollout_fn = rec(setup)

        async def recorded(row):
            result = await rollout_fn(row)
            if row["id"] >= 100:
                eval_versions.append(int(result.text))  # Recorder's text: the version that sampled it
            return result

        return recorded

    rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    assert pushed == [0, 2, 3]  # the initial push, after step 2 (the interval), after step 3 (for the eval)
    assert eval_versions == [0, 0, 3, 3]  # the eval before step 0, and the final one on the final weights


def test_resume_continues_at_next_step_with_next_rows(tiny_model_path, server, tmp_path):
    kw = dict(synchronous_training=True, shuffle_rows=False, dcp_save_interval=1)
    first = Recorder()
    async_rl_loop.main(config(tiny_model_path, server, tmp_path, max_steps=2, **kw), first, ROWS)
    second = Recorder()
    out = async_rl_loop.main(config(tiny_model_path, server, tmp_path, max_steps=4, **kw), second, ROWS)
    assert out["steps"] == 4
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert steps == [0, 1, 2, 3]
    assert sorted(set(first.rows)) == [0, 1, 2, 3]  # 2 steps x 2 groups, no shuffling
    assert sorted(set(second.rows)) == [4, 5, 6, 7]  # the next rows, none repeated
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_000004" / "recipe_state.json").read_text())
    assert state["step"] == 4 and state["cursor"]["done_floor"] == 8


def test_lr_schedule_is_logged_per_step_and_a_resume_continues_it(tiny_model_path, server, tmp_path):
    """``train/learning_rate`` follows the linear decay; the resumed run goes on from step 2, not from the peak."""
    kw = dict(synchronous_training=True, dcp_save_interval=1)
    peak = 1e-3
    trainer = TrainerConfig(learning_rate=peak, lr_schedule="linear")
    async_rl_loop.main(config(tiny_model_path, server, tmp_path, max_steps=2, trainer=trainer, **kw), Recorder(), ROWS)
    async_rl_loop.main(config(tiny_model_path, server, tmp_path, max_steps=4, trainer=trainer, **kw), Recorder(), ROWS)
    lrs = [r["train/learning_rate"] for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    # steps 0-1 decay over T = 2 (1, 1/2); the resume raised max_steps to 4: steps 2-3 continue over T = 4
    assert lrs == pytest.approx([peak, peak / 2, peak * (1 - 2 / 4), peak * (1 - 3 / 4)], rel=1e-9)


def test_resumed_weights_equal_saved_weights(tiny_model_path, tmp_path):
    import torch

    from training.trainer import PolicyTrainer
    from training.utils.checkpoint import load_checkpoint, save_checkpoint

    a = PolicyTrainer(tiny_model_path, TrainerConfig(learning_rate=1e-2))
    a.forward_backward([ROWS[0]["prompt_ids"] * 3], lambda packed, lp: (-lp.sum(), {}))
    a.optim_step()
    save_checkpoint(tmp_path, 1, a.model, a.optimizer, {"step": 1})
    b = PolicyTrainer(tiny_model_path, TrainerConfig(learning_rate=1e-2))
    assert load_checkpoint(tmp_path / "step_000001", b.model, b.optimizer) == {"step": 1}
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n
    assert torch.equal(a.optimizer.state_dict()["state"][0]["exp_avg"], b.optimizer.state_dict()["state"][0]["exp_avg"])


def test_failing_and_hanging_rollouts_cost_only_themselves(tiny_model_path, server, tmp_path):
    rec = Recorder(fail_for={0, 5}, hang_for={2})
    cfg = config(
        tiny_model_path,
        server,
        tmp_path,
        rollout_timeout_s=2.0,
        shuffle_rows=False,
        max_rollout_error_fraction=0.9,
        completions_per_prompt=3,
        max_steps=3,
    )
    out = async_rl_loop.main(cfg, rollout_fn_factory=rec, rows=ROWS)
    assert out["steps"] == 3
    m = read_metrics(cfg.log_path)
    assert sum(r["rollout/errors"] for r in m if "rollout/errors" in r) >= 6
    assert sum(r["rollout/timeouts"] for r in m if "rollout/timeouts" in r) >= 3


def test_too_many_failures_stop_the_run(tiny_model_path, server, tmp_path):
    rec = Recorder(fail_for=set(range(64)))
    cfg = config(tiny_model_path, server, tmp_path, max_rollout_error_fraction=0.5)
    with pytest.raises(RolloutFailureError, match="max_rollout_error_fraction"):
        async_rl_loop.main(cfg, rollout_fn_factory=rec, rows=ROWS)


def test_dynamic_filter_keeps_sampling_until_the_step_is_full(tiny_model_path, server, tmp_path):
    seen = []

    def keep_odd_rows(samples):
        seen.append(samples)
        return len(seen) % 2 == 0

    cfg = config(tiny_model_path, server, tmp_path, dynamic_filter_fn=keep_odd_rows, max_steps=2)
    out = async_rl_loop.main(cfg, rollout_fn_factory=Recorder(), rows=ROWS)
    m = [r for r in read_metrics(cfg.log_path) if "train/loss" in r]
    assert out["steps"] == 2 and all(r["rollout/groups"] == 2 for r in m)
    assert sum(r["rollout/filtered_groups"] for r in m) >= 3


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_policy_loss_runs_end_to_end(tiny_model_path, server, tmp_path, loss):
    cfg = config(
        tiny_model_path,
        server,
        tmp_path,
        loss=LossConfig(policy_loss=loss, kl_beta=0.01),
        ppo_mini_batches=2,
        max_head_offpolicy_versions=1,
    )
    out = async_rl_loop.main(cfg, rollout_fn_factory=Recorder(), rows=ROWS)
    last = out["last_metrics"]
    assert out["steps"] == 2 and last["train/optimizer_steps"] == 2
    assert last["train/grad_norm"] > 0


def test_deployment_failures_are_retried_once_and_rollout_bugs_are_not(tiny_model_path, server, tmp_path):
    from training.deployment.client import DeploymentRequestError

    attempts = {}

    def factory(setup):
        inner = Recorder()(setup)

        async def rollout_fn(row):
            attempts[row["id"]] = attempts.get(row["id"], 0) + 1
            if row["id"] == 0 and attempts[0] == 1:
                raise DeploymentRequestError("upstream went away", status=None)  # retried, then succeeds
            if row["id"] == 1:
                raise DeploymentRequestError("bad request", status=400)  # the rollout's own fault: not retried
            return await inner(row)

        return rollout_fn

    cfg = config(
        tiny_model_path,
        server,
        tmp_path,
        shuffle_rows=False,
        max_steps=1,
        completions_per_prompt=2,
        max_rollout_error_fraction=0.9,
    )
    async_rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    assert attempts[0] == 3 and attempts[1] == 2  # row 0: 2 completions + 1 retry; row 1: 2, no retries


def test_two_embedded_replicas_share_work_keep_affinity_and_sync_together(tiny_model_path, tmp_path, monkeypatch):
    """num_replicas=2: both replicas generate, a session sticks to one, and both serve the last version."""
    from training.deployment.client import DeploymentSampler

    seen = {}

    def factory(setup):
        inner = Recorder()(setup)
        sampler = setup.sampler

        async def rollout_fn(row):
            url = sampler.pick_replica(f"row-{row['id']}")
            seen.setdefault(row["id"], set()).add(url)
            await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1, max_tokens=2, session_id=f"row-{row['id']}")
            return await inner(row)

        return rollout_fn

    cfg = async_rl_loop.Config(
        base_model=tiny_model_path,
        log_path=str(tmp_path / "run"),
        completions_per_prompt=2,
        prompt_groups_per_step=4,
        max_tokens=4,
        max_steps=2,
        export_final_model=False,
        loss=LossConfig(kl_beta=0.0),
        deployment=DeployConfig(num_replicas=2),
    )
    versions = {}
    real_sync = async_rl_loop.RunContext.sync_weights

    async def sync_and_check(ctx, version, **kw):
        out = await real_sync(ctx, version, **kw)
        for url in ctx.deployment.base_urls:  # the barrier: every replica already serves the new version
            versions.setdefault(url, []).append(
                await DeploymentSampler(url, api_key=ctx.deployment.cfg.api_key).weight_version()
            )
        return out

    monkeypatch.setattr(async_rl_loop.RunContext, "sync_weights", sync_and_check)
    async_rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    assert len(versions) == 2 and all(v == [1, 2] for v in versions.values())
    assert all(len(urls) == 1 for urls in seen.values())  # affinity: one replica per session
    assert len({u for urls in seen.values() for u in urls}) == 2  # and both replicas got sessions
    assert (tmp_path / "run" / "deployment-0.log").exists() and (tmp_path / "run" / "deployment-1.log").exists()


def test_ppo_step_applies_sample_weights(tiny_model_path):
    """A step whose samples all weigh 0 moves nothing; weight 1 does (weights reach the loss)."""
    from training.trainer import PolicyTrainer
    from training.utils.rl.groups import PromptGroup
    from training.utils.rl.ppo import train_on_groups

    def group(weight):
        samples = [
            RolloutSample(
                tokens=[1, 10, 20, 30 + k],
                logprobs=[0.0, 0.0, -2.0, -2.0],
                loss_mask=[0, 0, 1, 1],
                reward=float(k),
                weight=weight,
            )
            for k in range(2)
        ]
        g = PromptGroup(
            position=0,
            row={},
            submit_version=0,
            samples=samples,
            completion_index=[0, 1],
            completion_rewards={0: 0.0, 1: 1.0},
        )
        g.compute_advantages()
        return g

    trainer = PolicyTrainer(tiny_model_path, TrainerConfig(learning_rate=1e-2))
    zero = train_on_groups(trainer, [group(0.0)], LossConfig(kl_beta=0.0))
    one = train_on_groups(trainer, [group(1.0)], LossConfig(kl_beta=0.0))
    assert zero["train/grad_norm"] == 0.0 and one["train/grad_norm"] > 0.0


def test_distributed_weight_sync_through_the_recipe(embedded_server, tiny_model_path, tmp_path):
    """weight_sync="distributed": the recipe streams weights over its own gloo group to an attached server."""
    import urllib.request

    with embedded_server(fresh=True, max_batch_size=8) as dep:  # fresh: it joins a group and takes pushes
        recorder = Recorder()
        cfg = config(
            tiny_model_path,
            dep,
            tmp_path,
            synchronous_training=True,
            max_steps=3,
            deployment=DeployConfig(
                base_url=dep.base_url, weight_sync="distributed", weight_sync_master_addr="127.0.0.1"
            ),
        )
        assert async_rl_loop.main(cfg, rollout_fn_factory=recorder, rows=ROWS)["steps"] == 3
        with urllib.request.urlopen(f"{dep.base_url}/weight_version", timeout=10) as resp:
            served = json.loads(resp.read())["weight_version"]
    # the initial push is version 0; each of the 3 steps pushes the next one
    assert served == 3
    assert sorted(set(recorder.versions)) == [0, 1, 2]


def test_distributed_weight_sync_config_is_checked():
    with pytest.raises(ValueError, match="weight_sync_master_addr"):
        DeployConfig(base_url="http://10.0.0.2:8000", weight_sync="distributed")
    with pytest.raises(ValueError, match="weight_sync"):  # SGLang's distributed routes are not wired
        DeployConfig(engine="sglang", weight_sync="distributed", weight_sync_master_addr="10.0.0.1")
    # launched servers may take it too (the Ray launcher's, on other nodes); on one host shm is the faster path
    assert DeployConfig(weight_sync="distributed", weight_sync_master_addr="10.0.0.1").weight_sync == "distributed"


def test_run_seed_reaches_the_servers_sampling(tiny_model_path, tmp_path):
    """A run's ``seed`` seeds the server it starts (EngineConfig.seed None): seeds 0 and 1 sample different
    completions of one prompt, and the same seed the same ones (one prompt, so arrival order cannot matter).
    Replicas of a group get seeds seed + i."""
    from training.deployment.group import replica_config

    def completions(seed: int, name: str) -> list[list[int]]:
        deployment = DeployConfig(engine_config=EngineConfig(max_batch_size=8))
        cfg = config(
            tiny_model_path,
            None,
            tmp_path / name,
            seed=seed,
            max_steps=1,
            max_tokens=8,
            prompt_groups_per_step=1,
            completions_per_prompt=4,
            deployment=deployment,
        )
        recorder = Recorder()
        rl_loop.main(cfg, rollout_fn_factory=recorder, rows=ROWS[:1])
        return sorted(recorder.outputs)

    first = completions(0, "a")
    assert len(first) == 4
    assert completions(0, "b") == first
    assert completions(1, "c") != first

    group = DeployConfig(num_replicas=3, engine_config=EngineConfig(seed=5))
    assert [replica_config(group, i).engine_config.seed for i in range(3)] == [5, 6, 7]
    unset = DeployConfig(num_replicas=2)
    assert [replica_config(unset, i).engine_config.seed for i in range(2)] == [0, 1]
    assert replica_config(DeployConfig(), 0).engine_config.seed is None


def test_cpu_share_splits_the_cores_only_when_trainer_and_servers_overlap_on_this_cpu(monkeypatch):
    from training.recipes.resources import CpuShare, cpu_share

    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)

    def share(overlaps=True, **kw):
        return cpu_share(async_rl_loop.Config(base_model="m", **kw), overlaps)

    assert share() == CpuShare(engine_threads=4, trainer_threads_busy=4, trainer_threads_idle=8)
    assert share(deployment=DeployConfig(num_replicas=2)) == CpuShare(2, 4, 8)
    assert share(deployment=DeployConfig(engine_config=EngineConfig(num_threads=2))) == CpuShare(2, 6, 8)
    assert share(trainer=TrainerConfig(num_threads=3)) == CpuShare(4, 3, 3)
    assert share(overlaps=False) is None
    assert share(deployment=DeployConfig(base_url="http://127.0.0.1:1")) is None
    monkeypatch.setenv("TRAINING_RAY_REPLICA_GROUP", "run-replicas")  # under the Ray launcher: the bundles split them
    assert share() is None
    monkeypatch.delenv("TRAINING_RAY_REPLICA_GROUP")
    assert async_rl_loop.AsyncRLLoop.overlaps(async_rl_loop.Config(base_model="m", max_head_offpolicy_versions=1))
    assert not async_rl_loop.AsyncRLLoop.overlaps(async_rl_loop.Config(base_model="m"))
    assert not rl_loop.SyncRLLoop.overlaps(async_rl_loop.Config(base_model="m", max_head_offpolicy_versions=1))


def test_overlapping_run_gives_server_and_trainer_their_share_of_the_cores(tiny_model_path, tmp_path, monkeypatch):
    """async_rl_loop with an embedded server on this CPU: the server runs ``cores // 2`` threads (its /stats says so),
    and the trainer asks a budget that is the rest while groups are in flight and every core otherwise."""
    cores = torch.get_num_threads()
    cfg = config(
        tiny_model_path,
        None,
        tmp_path,
        max_head_offpolicy_versions=1,
        deployment=DeployConfig(engine_config=EngineConfig(max_batch_size=8)),
    )
    server_threads, budgets = [], []

    class StatsRecorder(Recorder):
        def __call__(self, setup):
            rollout_fn = super().__call__(setup)

            async def with_stats(row):
                async with aiohttp.ClientSession() as session:
                    url, headers = setup.sampler.base_url + "/stats", auth_headers(setup.sampler.api_key)
                    async with session.get(url, headers=headers) as response:
                        server_threads.append((await response.json())["num_threads"])
                return await rollout_fn(row)

            return with_stats

    real = recipes_context.train_on_groups

    def spy(trainer, groups, *a, **kw):
        budgets.append((trainer.thread_budget is not None) and trainer.thread_budget())
        return real(trainer, groups, *a, **kw)

    monkeypatch.setattr(recipes_context, "train_on_groups", spy)
    before = torch.get_num_threads()
    try:
        assert async_rl_loop.main(cfg, rollout_fn_factory=StatsRecorder(), rows=ROWS)["steps"] == 2
    finally:
        torch.set_num_threads(before)
    assert set(server_threads) == {max(1, cores // 2)}
    assert len(budgets) == 2 and set(budgets) <= {max(1, cores - max(1, cores // 2)), cores}
