"""``sglang-kvbm doctor`` on a good set-up and on broken ones, as a person runs it."""

import os
import subprocess
import sys

from test_disk_tier import make_unwritable, make_writable


def doctor(env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYN_KVBM_", "SGLANG_KVBM_"))}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "sglang_kvbm.cli", "doctor"], env=env, capture_output=True,
                          text=True, timeout=120)


def test_good_setup_is_ready(tmp_path):
    run = doctor({"DYN_KVBM_CPU_CACHE_GB": "1", "DYN_KVBM_DISK_CACHE_GB": "0.5", "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stdout
    assert "sglang" in run.stdout and "0.5.23" in run.stdout
    assert "disk O_DIRECT       ok    on" in run.stdout
    assert run.stdout.rstrip().endswith("ready")


def test_bad_variable_is_a_problem_naming_it(tmp_path):
    run = doctor({"DYN_KVBM_CPU_CACHE_GB": "lots"})
    assert run.returncode == 1
    assert "DYN_KVBM_CPU_CACHE_GB='lots' is not a number" in run.stdout


def test_no_tier_is_a_problem():
    run = doctor({})
    assert run.returncode == 1 and "no tier configured" in run.stdout


def test_unwritable_disk_directory_is_a_problem(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    make_unwritable(locked)
    try:
        run = doctor({"DYN_KVBM_DISK_CACHE_GB": "0.1", "DYN_KVBM_DISK_CACHE_DIR": str(locked)})
    finally:
        make_writable(locked)
    assert run.returncode == 1
    assert "DYN_KVBM_DISK_CACHE_DIR" in run.stdout and "not writable" in run.stdout
