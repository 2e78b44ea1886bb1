"""Providers: an ordered rule list plus the mode (PTQ or QT) they run in."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from quantrules._errors import RuleError
from quantrules._rules import Mode, Rule

__all__ = ["PtqProvider", "QtProvider"]


@dataclasses.dataclass(frozen=True, init=False)
class _Provider:
    rules: tuple[Rule, ...]
    mode: Mode = "ptq"

    def __init__(self, rules: Iterable[Rule]) -> None:
        if isinstance(rules, Rule):
            rules = (rules,)
        rules = tuple(rules)
        for i, rule in enumerate(rules):
            if not isinstance(rule, Rule):
                raise RuleError(
                    f"{type(self).__name__}.rules[{i}]: expected a quantrules.Rule, got "
                    f"{type(rule).__name__} (convert Qwix rules with quantrules.from_qwix)"
                )
        object.__setattr__(self, "rules", rules)


@dataclasses.dataclass(frozen=True, init=False)
class PtqProvider(_Provider):
    """Post-training quantization with ``rules`` in first-match order.

    Every matched rule runs as PTQ, even a rule with ``mode='qt'`` (as in Qwix,
    where a ``PtqProvider`` ignores the training fields of a ``QtRule``).

    >>> PtqProvider([Rule(weight_qtype="int8")]).mode
    'ptq'
    """

    mode: Mode = "ptq"


@dataclasses.dataclass(frozen=True, init=False)
class QtProvider(_Provider):
    """Quantized training with ``rules`` in first-match order.

    Every matched rule runs as QT (Qwix's ``QtProvider`` likewise turns plain
    rules into ``QtRule`` with default training fields).

    >>> QtProvider([Rule(weight_qtype="int8")]).mode
    'qt'
    """

    mode: Mode = "qt"
