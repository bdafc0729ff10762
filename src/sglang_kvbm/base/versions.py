"""The SGLang releases this library is built against, and the check of an installed one.

One range, read by ``doctor`` and by the start-up check, so they cannot disagree.
This module imports neither SGLang nor torch: the check runs before either is
loaded, from the version string the package metadata gives. (``pyproject.toml``
repeats the range in its ``sglang`` extra; keep the two equal.)

The external-cache linker seam this library rides appeared in 0.5.21 (what
Dynamo 1.6.1 pins); what differs between 0.5.21, 0.5.22 and 0.5.23 is found by
feature detection in ``integration.sglang.compat``, never by comparing versions.
Pre-releases inside the range (``0.5.24rc1``) are accepted; 0.6 (pre-releases
included) is refused until verified.
"""

from __future__ import annotations

from importlib import metadata

from sglang_kvbm.base.values import ConfigError

SUPPORTED_SGLANG = ">=0.5.21,<0.6"

try:  # one version source: pyproject.toml's, through the installed metadata
    VERSION = metadata.version("sglang-kvbm")
except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
    VERSION = "0+unknown"


def check_sglang_version(installed: str) -> None:
    """Raise :class:`ConfigError` unless ``installed`` (e.g. ``"0.5.23"``) is in :data:`SUPPORTED_SGLANG`."""
    problem = unsupported_sglang(installed)
    if problem is not None:
        raise ConfigError(problem)


def unsupported_sglang(installed: str) -> "str | None":
    """Why ``installed`` cannot run this library (one line: the range and the fix), or None when it can."""
    from packaging.specifiers import SpecifierSet  # a dependency of SGLang (through transformers)
    from packaging.version import InvalidVersion, Version

    fix = f"pip install 'sglang{SUPPORTED_SGLANG}'"
    try:
        version = Version(installed)
    except InvalidVersion:
        return (f"the installed sglang reports version {installed!r}, which is not a version number; sglang-kvbm "
                f"supports sglang{SUPPORTED_SGLANG}: {fix}")
    if not SpecifierSet(SUPPORTED_SGLANG).contains(version, prereleases=True):
        return (f"sglang {installed} is installed, but sglang-kvbm supports sglang{SUPPORTED_SGLANG}: {fix}, "
                f"or use an sglang-kvbm release made for sglang {installed}")
    return None
