"""The CPU demo (``sglang-kvbm demo``): a locally generated model (``model``), SGLang servers (``server``)
and the run that compares stock SGLang with SGLang + this library (``run``)."""
