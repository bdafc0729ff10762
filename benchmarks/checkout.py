"""The benchmarks run from a checkout: the tests' harnesses (``tests/harness``, never shipped) are theirs too.

``import checkout`` before ``from harness... import``: it puts ``tests/`` on ``sys.path``.
"""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
