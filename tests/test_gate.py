"""The off-policy gate: admission throttle and the per-sample bound."""

import pytest

from training.utils.rl.gate import OffPolicyGate

pytestmark = pytest.mark.unit


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
