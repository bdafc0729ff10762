"""The examples run as documented, and do what they say."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_custom_server_example_serves_a_host_hit_with_cold_output(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_server.py"), "--tokens", "120", "--new", "6"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK: the host-tier prefix reproduced the cold run" in run.stdout
    assert "'from_host': 116" in run.stdout  # 120 tokens: 29 whole pages below the last token
