"""The trainer's own error type, in a module of its own so that the config schema and the objective
table can both raise it without importing each other."""

from vitforge.core import UsageError


class ConfigError(UsageError):
    kind = "config error"
