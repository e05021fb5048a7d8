"""Errors a user can act on. The CLI prints these without a traceback.

Raise `ConfigError` for a bad setting and `InputError` for bad or missing input data; the
message must name the file, line or key at fault and say how to fix it.
"""


class KilnError(Exception):
    """A user-facing error whose message alone tells the user what to do."""


class ConfigError(KilnError):
    """A config file, key or override is wrong."""


class InputError(KilnError):
    """An input path or file cannot be used as configured."""
