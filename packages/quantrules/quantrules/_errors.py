"""The error family of quantrules: every error names the argument at fault."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "QuantRulesError",
    "RuleError",
    "UnknownOpError",
    "UnknownQTypeError",
    "UnsupportedQTypeError",
]


class QuantRulesError(ValueError):
    """Base class of every quantrules error (a ``ValueError``)."""


class UnknownQTypeError(QuantRulesError):
    """A qtype name that is not in the registry."""


class UnsupportedQTypeError(QuantRulesError):
    """A known qtype that a back-end cannot represent."""


class UnknownOpError(QuantRulesError):
    """An op name that is not in the op registry."""


class RuleError(QuantRulesError):
    """A rule whose fields are invalid or contradict each other."""


class ConfigError(QuantRulesError):
    """A rule configuration (dict / JSON) that cannot be loaded."""
