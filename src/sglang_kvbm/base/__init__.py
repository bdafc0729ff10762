"""The ground floor: what every other part of the package may use, importing nothing of it.

``values`` (:class:`ConfigError` and the parsers every setting names), ``needs`` (what a part needs
beyond the base install, and the line that says how to get it), ``progress`` (long start-up work
shown as it goes), ``versions`` (the SGLang releases this library supports).
"""
