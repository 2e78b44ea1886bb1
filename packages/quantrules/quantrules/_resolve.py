"""Resolution: any accepted ``quant`` value -> the first matching rule."""

from __future__ import annotations

import dataclasses
from typing import Any

from quantrules._errors import QuantRulesError
from quantrules._ops import check_op
from quantrules._providers import PtqProvider, QtProvider
from quantrules._qtypes import get_qtype
from quantrules._rules import Mode, Rule

__all__ = [
    "Explanation",
    "Resolution",
    "as_rules",
    "explain",
    "normalize_module_path",
    "resolve",
    "weight_only",
]

#: Weight-only shorthands of these qtypes get this tile (group) size.
SHORTHAND_TILE_SIZE = 128
_TILED_SHORTHANDS = ("int4", "uint4", "nf4")


def weight_only(qtype: str) -> Rule:
    """The rule a dtype string stands for: weight-only, every op, PTQ.

    4-bit integer-like formats (int4, uint4, nf4) get a tile of 128 along the
    contraction axis; MX/NV formats keep their format-defined blocks.

    >>> weight_only("int4")
    Rule(module_path='.*', op_names=(), weight_qtype='int4', ..., tile_size=128, ...)
    """
    name = get_qtype(qtype).name
    tile = SHORTHAND_TILE_SIZE if name in _TILED_SHORTHANDS else None
    return Rule(weight_qtype=name, tile_size=tile)


@dataclasses.dataclass(frozen=True)
class Resolution:
    """The rule selected for one op: the rule, its index in the list, the mode.

    ``disabled`` is True when the rule sets no qtype: the op stays in float.
    """

    rule: Rule
    index: int
    mode: Mode

    @property
    def disabled(self) -> bool:
        return self.rule.disabled


@dataclasses.dataclass(frozen=True)
class _RuleSet:
    rules: tuple[Rule, ...]
    mode: Mode | None  # None: each rule's own mode
    # (module_path, op) -> result; filled by resolve().
    results: dict[tuple[str, str], Resolution | None] = dataclasses.field(
        default_factory=dict, compare=False, repr=False)


def _is_qwix(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "qwix"


def _to_rule(item: Any, where: str) -> Rule:
    if isinstance(item, Rule):
        return item
    if _is_qwix(item):
        from quantrules._qwix import from_qwix

        converted = from_qwix(item)
        if isinstance(converted, Rule):
            return converted
    raise QuantRulesError(
        f"{where}: expected a quantrules.Rule or a Qwix rule, got {type(item).__name__}"
    )


def _ruleset(quant: Any) -> _RuleSet | None:
    if quant is None:
        return None
    if isinstance(quant, str):
        return _RuleSet((weight_only(quant),), "ptq")
    if isinstance(quant, Rule):
        return _RuleSet((quant,), None)
    if isinstance(quant, PtqProvider | QtProvider):
        return _RuleSet(quant.rules, quant.mode)
    if _is_qwix(quant):
        from quantrules._qwix import from_qwix

        converted = from_qwix(quant)
        return _ruleset(converted)
    if isinstance(quant, tuple | list):
        return _RuleSet(tuple(_to_rule(r, f"quant[{i}]") for i, r in enumerate(quant)), None)
    raise QuantRulesError(
        "quant: expected None, a qtype string, a Rule, a sequence of rules or a provider "
        f"(quantrules' or Qwix's), got {type(quant).__name__}"
    )


def as_rules(quant: Any) -> tuple[tuple[Rule, ...], Mode | None]:
    """Normalize ``quant`` to ``(rules, mode)``; mode None means per-rule.

    >>> rules, mode = as_rules("int8")
    >>> rules[0].weight_qtype, mode
    ('int8', 'ptq')
    """
    rs = _compiled(quant)
    return ((), None) if rs is None else (rs.rules, rs.mode)


def normalize_module_path(module_path: str) -> str:
    """``/``-join a module path; a ``.``-joined path is accepted.

    >>> normalize_module_path("encoder.block1.conv")
    'encoder/block1/conv'
    """
    if not isinstance(module_path, str):
        raise QuantRulesError(f"module_path: expected a string, got {module_path!r}")
    if "/" not in module_path and "." in module_path:
        return module_path.replace(".", "/")
    return module_path


def _first_match(rs: _RuleSet, path: str, op: str) -> Resolution | None:
    for index, rule in enumerate(rs.rules):
        if rule.matches_op(op) and rule.pattern.fullmatch(path):
            return Resolution(rule, index, rs.mode or rule.mode)
    return None


# resolve() cache: id(quant) -> (what was seen, its compiled rule set). Keyed by
# identity so a hit costs no hashing of rules; a list is compared by content
# (its elements by identity first), any other object must be the same object,
# held here so its id cannot be reused. Bounded by clearing when full.
_CACHE: dict[int, tuple[Any, _RuleSet | None]] = {}
_CACHE_LIMIT = 4096
_RESULTS_LIMIT = 65536


def _compiled(quant: Any) -> _RuleSet | None:
    key = id(quant)
    entry = _CACHE.get(key)
    if type(quant) is list:
        snapshot = tuple(quant)
        if entry is not None and entry[0] == snapshot:
            return entry[1]
        held, rs = snapshot, _ruleset(snapshot)
    else:
        if entry is not None and entry[0] is quant:
            return entry[1]
        held, rs = quant, _ruleset(quant)
    if len(_CACHE) >= _CACHE_LIMIT:
        _CACHE.clear()
    _CACHE[key] = (held, rs)
    return rs


def _clear_cache() -> None:
    """Drop every cached resolution (for benchmarks and tests)."""
    _CACHE.clear()


def resolve(quant: Any, *, module_path: str = "", op: str) -> Resolution | None:
    """The first rule of ``quant`` matching ``(module_path, op)``, or None.

    ``quant`` may be ``None``, a dtype string (weight-only shorthand), a
    :class:`Rule`, a sequence of rules, a :class:`PtqProvider` /
    :class:`QtProvider`, or Qwix's ``QuantizationRule`` / ``QtRule`` /
    ``PtqProvider`` / ``QtProvider``. Matching uses ``re.fullmatch`` on the
    ``/``-joined path, exactly as Qwix. A matching rule with no qtype is
    returned too (``disabled``): it stops the search. Repeated calls are
    served from a cache (providers and tuples are taken as immutable).

    >>> rules = [Rule(module_path="head", weight_qtype=None),
    ...          Rule(module_path=".*", op_names=("dot_general",), weight_qtype="int8")]
    >>> resolve(rules, module_path="block/0", op="einsum").index
    1
    >>> resolve(rules, module_path="head", op="einsum").disabled
    True
    >>> resolve(rules, module_path="block", op="conv_general_dilated") is None
    True
    """
    rs = _compiled(quant)
    if rs is None:
        check_op(op)
        return None
    results = rs.results
    try:
        return results[module_path, op]
    except KeyError:
        pass
    except TypeError:  # an unhashable argument
        check_op(op)
        raise QuantRulesError(f"module_path: expected a string, got {module_path!r}") from None
    check_op(op)
    found = _first_match(rs, normalize_module_path(module_path), op)
    if len(results) >= _RESULTS_LIMIT:
        results.clear()
    results[module_path, op] = found
    return found


@dataclasses.dataclass(frozen=True)
class Explanation:
    """A readable trace of :func:`resolve`: each rule tried and why.

    ``str(explanation)`` is the trace; ``resolution`` the outcome;
    ``steps`` holds ``(index, matched, reason)`` per rule tried.
    """

    module_path: str
    op: str
    resolution: Resolution | None
    steps: tuple[tuple[int, bool, str], ...]
    source: str

    @property
    def summary(self) -> str:
        """One line: the chosen rule or why nothing quantizes."""
        res = self.resolution
        if res is None:
            return "no rule matched: float"
        if res.disabled:
            return f"rule #{res.index} matched and disables quantization: float"
        return f"rule #{res.index} ({res.mode}): {_describe(res.rule)}"

    def __str__(self) -> str:
        lines = [f"resolve {self.op!r} at {self.module_path!r} ({self.source}):"]
        lines += [f"  #{i}: {'MATCH' if ok else 'skip '} {why}" for i, ok, why in self.steps]
        lines.append(f"  => {self.summary}")
        return "\n".join(lines)


def _describe(rule: Rule) -> str:
    parts = [f"{k}={getattr(rule, k)}" for k in ("weight_qtype", "act_qtype", "bwd_qtype")
             if getattr(rule, k) is not None]
    if rule.tile_size is not None:
        parts.append(f"tile_size={rule.tile_size}")
    return ", ".join(parts) or "no qtype"


def explain(quant: Any, *, module_path: str = "", op: str) -> Explanation:
    """Explain how :func:`resolve` treats ``(module_path, op)``.

    >>> print(explain([Rule(module_path="enc/.*", weight_qtype="int4", tile_size=32),
    ...                Rule(op_names=("einsum",), weight_qtype="int8")],
    ...               module_path="dec.out", op="dot_general"))
    resolve 'dot_general' at 'dec/out' (2 rules):
      #0: skip  module path 'dec/out' does not fullmatch 'enc/.*'
      #1: skip  op 'dot_general' not in op_names ('einsum',)
      => no rule matched: float
    """
    check_op(op)
    rules, mode = as_rules(quant)
    path = normalize_module_path(module_path)
    source = f"{len(rules)} rule{'s' if len(rules) != 1 else ''}"
    if isinstance(quant, str):
        source = f"weight-only shorthand {quant!r}"
    steps = []
    found = None
    for index, rule in enumerate(rules):
        if not rule.matches_op(op):
            steps.append((index, False, f"op {op!r} not in op_names {rule.op_names}"))
        elif not rule.pattern.fullmatch(path):
            steps.append((index, False,
                          f"module path {path!r} does not fullmatch {rule.module_path!r}"))
        else:
            steps.append((index, True,
                          f"module path {path!r} fullmatches {rule.module_path!r}, "
                          f"op {op!r} {'in op_names' if rule.op_names else 'allowed (any op)'}"))
            found = Resolution(rule, index, mode or rule.mode)
            break
    return Explanation(path, op, found, tuple(steps), source)

