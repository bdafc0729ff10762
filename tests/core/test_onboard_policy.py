"""The disk onboarding policy: load while reading beats recomputing, and keep finding out whether it does.

Samples go into the meters the way the server records them (the read meter after
each verified disk read, the prefill meter after each prefill).
"""

from __future__ import annotations

import pytest

from sglang_kvbm.config import KvbmConfig
from sglang_kvbm.core.onboard_policy import LinearCostMeter, OnboardPolicy

BYTES_PER_TOKEN = 1000
SPAN = 100  # tokens of the disk span asked about


def measured_policy(probe_every: int = 8) -> OnboardPolicy:
    """Prefill at 100 us/token, disk reads at 10 us/token: loading pays."""
    policy = OnboardPolicy(BYTES_PER_TOKEN, probe_every=probe_every)
    for tokens in (50, 100, 200, 400):
        policy.prefill.record(tokens, tokens * 100e-6)
    read_fast(policy)
    return policy


def read_fast(policy: OnboardPolicy) -> None:
    policy.read.record(SPAN * BYTES_PER_TOKEN, SPAN * 10e-6)


def slow_phase(policy: OnboardPolicy) -> None:
    """A full window of reads at 1 ms/token (10x slower than recomputing): the policy stops loading."""
    for _ in range(64):
        policy.read.record(SPAN * BYTES_PER_TOKEN, SPAN * 1e-3)


def decide(policy: OnboardPolicy, n: int) -> list[bool]:
    return [policy.disk_pays(SPAN) for _ in range(n)]


def test_loads_while_reading_pays_and_recomputes_after_a_slow_phase():
    policy = measured_policy()
    assert decide(policy, 3) == [True] * 3
    slow_phase(policy)
    assert policy.disk_pays(SPAN) is False
    assert policy.decisions["recompute"] == 1


def test_a_probe_that_reads_fast_again_brings_loading_back():
    policy = measured_policy(probe_every=8)
    slow_phase(policy)
    answers = decide(policy, 8)
    assert answers == [False] * 7 + [True]  # the 8th recompute decision is a probe: it loads
    assert policy.decisions["probe"] == 1
    read_fast(policy)  # the probe's read, recorded as the server records every disk read
    assert decide(policy, 20) == [True] * 20
    assert policy.decisions["probe"] == 1 and policy.break_even_tokens() < SPAN


def test_a_probe_that_reads_slow_leaves_the_policy_recomputing():
    policy = measured_policy(probe_every=8)
    slow_phase(policy)
    assert decide(policy, 8)[-1] is True
    policy.read.record(SPAN * BYTES_PER_TOKEN, SPAN * 1e-3)  # still slow
    assert decide(policy, 7) == [False] * 7
    assert policy.decisions["probe"] == 1


@pytest.mark.parametrize("probe_every", [1, 8, 32])
def test_probes_are_one_in_probe_every_recompute_decisions(probe_every):
    policy = measured_policy(probe_every=probe_every)
    slow_phase(policy)
    answers = decide(policy, 320)  # the probes' reads never land: nothing changes the estimates
    assert sum(answers) == policy.decisions["probe"] == 320 // probe_every
    assert policy.decisions["recompute"] == 320 - 320 // probe_every


def test_default_probe_rate_is_bounded():
    policy = OnboardPolicy(BYTES_PER_TOKEN)
    assert 8 <= policy.probe_every <= 256
    with pytest.raises(ValueError, match="probe_every"):
        OnboardPolicy(BYTES_PER_TOKEN, probe_every=0)


def test_always_reads_every_disk_hit_however_slow_the_disk_measures():
    """SGLANG_KVBM_DISK_ONBOARD=always: the meters are kept (the logs, the break-even), the decision is pinned."""
    policy = OnboardPolicy(BYTES_PER_TOKEN, always=True)
    for tokens in (50, 100, 200, 400):
        policy.prefill.record(tokens, tokens * 100e-6)
    slow_phase(policy)
    assert decide(policy, 40) == [True] * 40
    assert policy.decisions == {"load (always)": 40} and policy.break_even_tokens() == float("inf")
    assert KvbmConfig.from_env({"SGLANG_KVBM_DISK_ONBOARD": "Always"}).disk_onboard == "always"
    assert KvbmConfig.from_env({}).disk_onboard == "measured"


def test_unmeasured_disk_loads_without_probing():
    policy = OnboardPolicy(BYTES_PER_TOKEN)
    assert decide(policy, 3) == [True] * 3
    assert policy.decisions["load (not measured yet)"] == 3 and policy.decisions["probe"] == 0


def test_meter_keeps_its_window_and_counts_every_sample():
    meter = LinearCostMeter(window=4)
    for i in range(1, 7):
        meter.record(i, i * 2.0)
    meter.record(0, 1.0)  # no units: not a sample
    assert len(meter) == 4 and meter.recorded == 6
    assert meter.fit() == pytest.approx((0.0, 2.0))
    meter.keep_since(5)  # the samples recorded from the 6th on
    assert len(meter) == 1 and meter.estimate(10) == pytest.approx(20.0)
