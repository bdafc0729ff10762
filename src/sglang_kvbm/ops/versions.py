"""The SGLang releases this library is built against, and the check of an installed one.

One range, read by ``doctor`` and by the start-up check, so they cannot disagree.
This module imports neither SGLang nor torch: the check runs before either is
loaded, from the version string the package metadata gives. (``pyproject.toml``
repeats the range in its ``sglang`` extra; keep the two equal.)

Pre-releases inside the range (``0.5.24rc1``) are accepted: the seams this
library uses appeared in 0.5.23 and hold through 0.5.x; 0.6 (pre-releases
included) is refused until verified.
"""

from __future__ import annotations

from sglang_kvbm.config import ConfigError

SUPPORTED_SGLANG = ">=0.5.23,<0.6"


def check_sglang_version(installed: str) -> None:
    """Raise :class:`ConfigError` unless ``installed`` (e.g. ``"0.5.23"``) is in :data:`SUPPORTED_SGLANG`."""
    from packaging.specifiers import SpecifierSet  # a dependency of SGLang (through transformers)
    from packaging.version import InvalidVersion, Version

    fix = f"pip install 'sglang{SUPPORTED_SGLANG}'"
    try:
        version = Version(installed)
    except InvalidVersion:
        raise ConfigError(
            f"the installed sglang reports version {installed!r}, which is not a version number; sglang-kvbm "
            f"supports sglang{SUPPORTED_SGLANG}: {fix}"
        ) from None
    if not SpecifierSet(SUPPORTED_SGLANG).contains(version, prereleases=True):
        raise ConfigError(
            f"sglang {installed} is installed, but sglang-kvbm supports sglang{SUPPORTED_SGLANG}: {fix}, "
            f"or use an sglang-kvbm release made for sglang {installed}"
        )
