"""Static checks of a rule list: unreachable rules, dead rules, duplicates."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any, Literal

from quantrules._ops import known_ops
from quantrules._resolve import as_rules
from quantrules._rules import Rule

__all__ = ["LintIssue", "lint"]

_MATCH_ALL = (".*", "(.*)", ".*?", "(?s:.*)")
_META = re.compile(r"[.^$*+?{}\[\]\\|()]")


@dataclasses.dataclass(frozen=True)
class LintIssue:
    """One finding: ``kind`` is ``"duplicate"``, ``"unreachable"`` or ``"dead"``."""

    index: int
    kind: Literal["duplicate", "unreachable", "dead"]
    message: str
    shadowed_by: int | None = None

    def __str__(self) -> str:
        return f"rule #{self.index}: {self.kind}: {self.message}"


def _ops_matched(rule: Rule, ops: tuple[str, ...]) -> set[str]:
    return {op for op in ops if rule.matches_op(op)}


def _literal_prefix(pattern: str) -> tuple[str, bool] | None:
    """``(prefix, open)`` for a pattern that is a literal, or a literal + ``.*``."""
    if pattern.endswith(".*") and not _META.search(pattern[:-2]):
        return pattern[:-2], True
    unescaped = re.sub(r"\\(.)", r"\1", pattern)
    if re.escape(unescaped) == pattern or not _META.search(pattern):
        return unescaped, False
    return None


def _covers(earlier: str, later: str) -> bool:
    """Whether every path matching ``later`` also matches ``earlier``.

    Sound but incomplete: only decides match-all, equal, literal and
    literal-prefix patterns (regex containment is undecidable in general).
    """
    if earlier in _MATCH_ALL or earlier == later:
        return True
    lat = _literal_prefix(later)
    if lat is None:
        return False
    text, is_open = lat
    if not is_open:
        return re.fullmatch(earlier, text) is not None
    ear = _literal_prefix(earlier)
    return ear is not None and ear[1] and text.startswith(ear[0])


def lint(rules: Any, *, ops: Iterable[str] | None = None) -> list[LintIssue]:
    """Report rules that can never be selected.

    * ``duplicate``: equal to an earlier rule;
    * ``unreachable``: an earlier rule matches every (path, op) it would;
    * ``dead``: it matches none of ``ops`` (default: every registered op),
      e.g. a ``sparse_conv`` rule handed to a JAX-only consumer.

    ``rules`` is anything :func:`resolve` accepts.

    >>> for issue in lint([Rule(module_path="enc/.*", weight_qtype="int8"),
    ...                    Rule(module_path="enc/conv1", weight_qtype="int4"),
    ...                    Rule(op_names=("sparse_conv",), weight_qtype="int8")],
    ...                   ops=("dot_general", "einsum")):
    ...     print(issue)
    rule #1: unreachable: every path and op it matches is matched first by rule #0 ('enc/.*')
    rule #2: dead: op_names ('sparse_conv',) match none of the ops dot_general, einsum
    """
    rule_list, _ = as_rules(rules)
    op_set = tuple(ops) if ops is not None else known_ops()
    issues: list[LintIssue] = []
    for j, rule in enumerate(rule_list):
        matched = _ops_matched(rule, op_set)
        if not matched:
            issues.append(LintIssue(j, "dead", f"op_names {rule.op_names} match none of the ops "
                                    f"{', '.join(op_set)}"))
            continue
        for i in range(j):
            earlier = rule_list[i]
            if earlier == rule:
                issues.append(LintIssue(j, "duplicate", f"identical to rule #{i}", i))
                break
            if matched <= _ops_matched(earlier, op_set) and _covers(
                earlier.module_path, rule.module_path
            ):
                issues.append(LintIssue(
                    j, "unreachable",
                    f"every path and op it matches is matched first by rule #{i} "
                    f"({earlier.module_path!r})", i))
                break
    return issues

