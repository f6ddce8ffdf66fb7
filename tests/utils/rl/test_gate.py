"""The off-policy gate: admission throttle and the per-sample bound."""

import random

import pytest

from training.utils.rl.gate import OffPolicyGate


def test_strict_on_policy_serialises_at_batch_boundaries():
    gate = OffPolicyGate(max_offpolicy_versions=0, groups_per_step=4)
    # assembling step 0 with version 0 deployed: one batch worth may be outstanding
    assert gate.submit_capacity(deployed_version=0, trainer_version=0) == 4
    assert gate.can_submit(0, 0, 3) and not gate.can_submit(0, 0, 4)
    # while step 0 trains the batch of step 1 is assembled, but version 1 is not deployed: nothing may start
    assert gate.submit_capacity(deployed_version=0, trainer_version=1) == 0


@pytest.mark.parametrize("O", [1, 2])
def test_offpolicy_capacity_grows_with_O(O):
    gate = OffPolicyGate(max_offpolicy_versions=O, groups_per_step=3)
    assert gate.submit_capacity(0, 0) == 3 * (O + 1)
    assert gate.submit_capacity(0, 1) == 3 * O


@pytest.mark.parametrize("O", [0, 1, 2])
def test_gate_never_trains_beyond_bound(O):
    gate = OffPolicyGate(max_offpolicy_versions=O, groups_per_step=1)
    for submit in range(0, 6):
        for step in range(submit, submit + 5):
            admitted = gate.admit(submit, step, num_samples=2)
            assert admitted == (step - submit <= O)
    m = gate.step_metrics()
    assert m["offpolicy/staleness_max"] <= O
    assert m["offpolicy/dropped_stale"] == m["offpolicy/dropped_stale_total"] == 2 * 6 * (5 - (O + 1))
    assert not gate.admit(0, O + 1, num_samples=3)
    assert gate.step_metrics()["offpolicy/dropped_stale"] == 3  # per step; the total keeps counting
    assert sum(m[f"offpolicy/staleness_hist_{k}"] for k in range(O + 1)) == 2 * 6 * (O + 1)


def test_bad_gate_settings():
    with pytest.raises(ValueError, match="max_offpolicy_versions"):
        OffPolicyGate(-1, 1)
    with pytest.raises(ValueError, match="groups_per_step"):
        OffPolicyGate(0, 0)


def test_wait_takes_oldest_first_and_waits_when_a_deadline_needs_a_running_group():
    gate = OffPolicyGate(max_offpolicy_versions=2, groups_per_step=1)
    # step 0: two groups of version 0 run, a younger one (version 0 too) finished: plenty of slack, bypass it
    assert gate.plan_batch(0, ready_versions=[0], running_versions=[0, 0]) == [0]
    # step 2: two groups of version 0 still outstanding, both due now: one step cannot take both,
    # so admission / consumption must never let this happen; with one due and running, wait for it
    assert gate.plan_batch(2, ready_versions=[2], running_versions=[0]) is None
    assert gate.plan_batch(2, ready_versions=[0, 2], running_versions=[]) == [0]  # the due one, oldest first
    # step 1 with versions 0, 0 outstanding (due at 2) and B = 1: step 1 must take one of them
    assert gate.required(1, [0, 0, 1]) == {2: 1, 3: 1}
    assert gate.plan_batch(1, ready_versions=[1], running_versions=[0, 0]) is None
    assert gate.plan_batch(1, ready_versions=[0, 1], running_versions=[0]) == [0]


def test_bypass_window_shrinks_as_deadlines_approach():
    gate = OffPolicyGate(max_offpolicy_versions=1, groups_per_step=4)
    assert gate.bypass_window(0, [0] * 4) == 4  # due at step 1: step 0 may take anything
    assert gate.bypass_window(1, [0] * 3 + [1] * 4) == 1  # three are due now: one free slot
    assert gate.bypass_window(1, [0] * 4 + [1] * 4) == 0


def test_drop_policy_never_waits_for_older_groups():
    gate = OffPolicyGate(max_offpolicy_versions=1, groups_per_step=1, stale_policy="drop")
    assert gate.plan_batch(1, ready_versions=[1], running_versions=[0]) == [0]
    assert gate.plan_batch(1, ready_versions=[], running_versions=[0]) is None


def simulate(policy: str, O: int, B: int, seed: int, rows: int = 120, train_time: int = 3, sync_interval: int = 1):
    """A discrete-time run of admission + plan_batch with long-tailed rollout durations.

    Returns (staleness of every trained group, trained row ids in order, dropped row ids)."""
    rng = random.Random(seed)
    gate = OffPolicyGate(O, B, policy)
    t, deployed, step, training_until = 0, 0, 0, None
    queue = list(range(rows))
    running, ready, trained, staleness, dropped, ticket = [], [], [], [], [], 0
    while len(trained) < rows:
        for r in [r for r in running if r[0] <= t]:
            running.remove(r)
            ready.append(r)
        ready.sort(key=lambda r: r[1])
        if training_until is not None and t >= training_until:
            training_until = None
            if step % sync_interval == 0:
                deployed = step
        if training_until is None:
            if policy == "drop":
                for r in [r for r in ready if not gate.is_fresh(r[2], step)]:
                    ready.remove(r)
                    dropped.append(r[3])
                    queue.insert(0, r[3])  # requeued
            plan = (
                gate.plan_batch(step, [r[2] for r in ready], [r[2] for r in running])
                if len(ready) >= B or (not queue and not running and ready)
                else None
            )
            if plan is not None:
                for i in plan:
                    staleness.append(step - ready[i][2])
                    trained.append(ready[i][3])
                ready = [r for i, r in enumerate(ready) if i not in plan]
                step += 1
                training_until = t + train_time
        while queue and gate.can_submit(deployed, step, len(ready) + len(running)):
            duration = int(rng.paretovariate(1.2))  # long tail: mostly 1-3, sometimes 30+
            running.append((t + duration, ticket, deployed, queue.pop(0)))
            ticket += 1
        t += 1
        assert t < 100_000, "the simulated run stalled"
    return staleness, trained, dropped


@pytest.mark.parametrize("O,B,interval", [(1, 1, 1), (1, 4, 1), (2, 1, 1), (2, 3, 1), (3, 2, 1), (1, 2, 2), (2, 1, 3)])
@pytest.mark.parametrize("seed", range(5))
def test_wait_policy_trains_every_row_once_within_the_bound(O, B, interval, seed):
    staleness, trained, dropped = simulate("wait", O, B, seed, sync_interval=interval)
    assert max(staleness) <= O
    assert sorted(trained) == list(range(120))  # nothing lost, nothing twice
    assert dropped == []


def test_drop_policy_requeues_dropped_rows_and_trains_each_once():
    staleness, trained, dropped = simulate("drop", 1, 1, seed=3)
    assert dropped, "this seed's long tail should overrun O=1"
    assert max(staleness) <= 1
    assert sorted(trained) == list(range(120))


def test_token_lag_histogram_from_per_token_versions():
    gate = OffPolicyGate(max_offpolicy_versions=2, groups_per_step=1)
    gate.record_token_versions(5, [3, 3, 4, 5])  # a sequence that spanned two in-flight updates
    gate.record_token_versions(5, None)  # a sample without versions adds nothing
    m = gate.step_metrics()
    assert m["offpolicy/token_lag_mean"] == 1.25 and m["offpolicy/token_lag_max"] == 2
    assert [m[f"offpolicy/token_lag_hist_{k}"] for k in range(3)] == [1, 1, 2]
    assert "offpolicy/token_lag_mean" not in gate.step_metrics()  # reset per step; absent without versions
