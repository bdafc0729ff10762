"""Print the requirements of an installed distribution, as pip would resolve them here, less the named ones.

``make compat`` installs an SGLang release with ``--no-deps`` (0.5.21 and 0.5.22 pin ``cuda-tile==1.6.0rc5``,
a placeholder PyPI cannot install), then what this prints: its own requirements for this interpreter and
platform, without extras, less ``--without`` names.

    python tests/compat/requirements_of.py sglang --without cuda-tile
"""

from __future__ import annotations

import argparse
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("distribution")
    parser.add_argument("--without", nargs="*", default=[])
    args = parser.parse_args()
    left_out = {canonicalize_name(name) for name in args.without}
    for line in metadata.requires(args.distribution) or ():
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) in left_out:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        requirement.marker = None
        print(requirement)


if __name__ == "__main__":
    main()
