"""KVBM's disk offload filter: its counting rules, and decay that costs nothing for the entries it does not touch.

Micro-measurement (``PYTHONPATH=src python tests/core/test_offload_filter.py``): 1M random 64-bit keys, each
offered twice, fake clock, 2-core VM (CPython 3.11), two runs each on a quiet machine:

=========================================  =========================  ===============================
time per ``offer``                         before (eager decay)       after (lazy decay)
=========================================  =========================  ===============================
known key, no decay due                    0.50 us                    0.90 us
the offer that crosses a decay boundary    263-274 ms                 0.009 ms
100k new keys at the 1M cap                mean 3.3 us, worst 270 ms  mean 0.8 us, worst 0.15 ms
                                           (whole-table decays)
=========================================  =========================  ===============================

Still there after: CPython compacts a dict with many deletions, about 0.13 s at 1M keys once every
~350k new keys at the cap (measured on a bare ``OrderedDict``); amortized O(1), not avoidable in a dict.
"""

from __future__ import annotations

import random
import time

import pytest

from sglang_kvbm.core.offload_filter import FrequencyFilter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Key:
    """A key that counts how often the filter hashes it: a decay must not walk the whole table."""

    hashed = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        Key.hashed += 1
        return self.n

    def __eq__(self, other) -> bool:
        return isinstance(other, Key) and other.n == self.n


def make(**kwargs) -> tuple[FrequencyFilter, Clock]:
    clock = Clock()
    return FrequencyFilter(clock=clock, **kwargs), clock


def test_count_starts_at_one_and_doubles_and_earns_disk_at_two():
    f, _ = make()
    assert f.offer("a") is False and f.count("a") == 1
    assert f.offer("a") is True and f.count("a") == 2
    f.offer("a")
    f.offer("a")
    assert f.count("a") == 8
    assert f.count("never") == 0


def test_each_decay_interval_takes_one_off_and_zero_is_forgotten():
    f, clock = make(decay_interval_s=10.0)
    for _ in range(3):
        f.offer("a")  # 4
    clock.now += 9.9
    assert f.count("a") == 4  # no interval boundary crossed yet
    clock.now += 0.1
    assert f.count("a") == 3
    clock.now += 25
    assert f.count("a") == 1  # two more boundaries
    clock.now += 10
    assert f.count("a") == 0
    assert f.offer("a") is False and f.count("a") == 1  # forgotten: counts from 1 again


def test_decay_boundaries_are_fixed_not_per_key():
    """KVBM decays the whole table on one timer: a key offered just before a tick loses 1 at that tick."""
    f, clock = make(decay_interval_s=10.0)
    clock.now += 9.5
    f.offer("a")
    f.offer("a")  # 2, half a second before the first tick
    clock.now += 0.5
    assert f.count("a") == 1


def test_decay_is_exact_after_a_long_idle():
    f, clock = make(decay_interval_s=1.0)
    for _ in range(8):
        f.offer("a")  # 128
    clock.now += 100
    assert f.count("a") == 28


def test_count_saturates_like_kvbm_i64():
    f, _ = make()
    for _ in range(200):
        f.offer("a")
    assert f.count("a") == (1 << 63) - 1


def test_decay_does_not_walk_the_table():
    f, clock = make(decay_interval_s=10.0)
    keys = [Key(i) for i in range(1000)]
    for key in keys:
        f.offer(key)
        f.offer(key)  # count 2: an eager decay keeps (and re-hashes) it
    clock.now += 10
    Key.hashed = 0
    f.offer(Key(5000))
    assert Key.hashed <= 2, f"a decay step hashed {Key.hashed} keys; it must touch only the key offered"
    assert f.count(keys[3]) == 1 and f.count(Key(5000)) == 1


def test_table_full_forgets_the_least_recently_offered():
    f, _ = make(max_entries=3)
    for key in "abc":
        f.offer(key)
    f.offer("a")  # a is now the most recent (count 2)
    assert f.offer("d") is False
    assert [f.count(k) for k in "abcd"] == [2, 0, 1, 1]
    f.offer("e")
    assert [f.count(k) for k in "abcde"] == [2, 0, 0, 1, 1]


def test_forgotten_and_decayed_entries_are_not_counted():
    f, clock = make(max_entries=2, decay_interval_s=1.0)
    f.offer("a")
    clock.now += 1  # a decays to 0
    f.offer("b")
    f.offer("b")
    f.offer("c")
    assert [f.count(k) for k in "abc"] == [0, 2, 1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"threshold": 0}, "threshold=0"),
        ({"decay_interval_s": 0}, "decay_interval_s=0"),
        ({"decay_interval_s": float("nan")}, "decay_interval_s=nan"),
        ({"max_entries": 0}, "max_entries=0"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FrequencyFilter(**kwargs)


def _measure(n: int = 1 << 20) -> None:
    """Time per offer at ``n`` keys (each offered twice, as reused blocks are): steady, at a decay boundary,
    and at the entry cap, where the filter must make room."""

    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(n + 100_001)]  # block ids are 64-bit hashes

    def filled(max_entries: int) -> tuple[FrequencyFilter, Clock]:
        clock = Clock()
        f = FrequencyFilter(max_entries=max_entries, clock=clock)
        for key in keys[:n]:
            f.offer(key)
            f.offer(key)
        return f, clock

    def timed(f: FrequencyFilter, keys) -> tuple[float, float, int]:
        """Mean and worst seconds per offer, and how many offers took over a millisecond."""
        times = []
        for key in keys:
            start = time.perf_counter()
            f.offer(key)
            times.append(time.perf_counter() - start)
        return sum(times) / len(times), max(times), sum(t > 1e-3 for t in times)

    f, clock = filled(2 * n)
    mean, worst, slow = timed(f, keys[:100_000])
    print(f"steady offer of a known key: mean {mean * 1e6:.2f} us, worst {worst * 1e3:.3f} ms, {slow} over 1 ms")
    clock.now += 10
    mean, _, _ = timed(f, [keys[n]])
    print(f"the offer that crosses a decay boundary: {mean * 1e3:.3f} ms")
    f, _ = filled(n)
    mean, worst, slow = timed(f, keys[n + 1 :])
    print(f"100k new keys at the cap: mean {mean * 1e6:.2f} us, worst {worst * 1e3:.3f} ms, {slow} over 1 ms")


if __name__ == "__main__":
    _measure()
