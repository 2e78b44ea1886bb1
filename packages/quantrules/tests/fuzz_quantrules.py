"""Fuzz targets of quantrules' public entry points (Hypothesis).

Budget and replay: ``tools/fuzzing.py`` (``QUANTLATTICE_FUZZ_EXAMPLES``,
``QUANTLATTICE_FUZZ_SEED``). Every target accepts only two outcomes: a valid
result checked against a reference, or a ``QuantRulesError``.
"""

from __future__ import annotations

import contextlib
import json
import re

from fuzzing import fuzz
from hypothesis import strategies as st

import quantrules as qr
from quantrules import Rule

SEGMENTS = ["enc", "dec", "block0", "b.1", "conv", "head", "a-b", "x*y", ""]
OPS = ["dot_general", "einsum", "conv_general_dilated", "sparse_conv"]
PATTERNS = [".*", "enc/.*", "dec/.*", ".*/conv", "block[01]/.*", "head", "(enc|dec)/block0/.*",
            ".*?", "(.*)", "enc", "", ".+/conv", r"a\-b", r"x\*y/.*", "(?s:.*)"]

# Printable paths (a module path with a newline is not a module path: the
# lint's ".*" covers-all shortcut assumes none).
paths = st.lists(st.sampled_from(SEGMENTS) | st.text("abc./-_*", max_size=4), max_size=4).map(
    "/".join
)
rules = st.builds(
    Rule,
    module_path=st.sampled_from(PATTERNS) | paths.map(re.escape),
    op_names=st.lists(st.sampled_from(OPS), max_size=2, unique=True).map(tuple),
    weight_qtype=st.sampled_from([None, "int8", "int4", "fp8", "NF4", "mxfp8"]),
    act_qtype=st.sampled_from([None, "int8", "e5m2"]),
    tile_size=st.sampled_from([None, 1, 32, 128, 0.5, 1.0]),
)

# Any JSON value, with the rule fields' names among the keys.
FIELD_NAMES = [
    "module_path", "op_names", "weight_qtype", "act_qtype", "bwd_qtype", "tile_size",
    "weight_calibration_method", "act_calibration_method", "act_batch_axes",
    "act_static_scale", "mode", "bwd_calibration_method", "bwd_weight_grad_tile_size",
    "disable_channelwise_axes", "bwd_stochastic_rounding", "channelwise_noise_axes",
    "additional_qt_config", "provider", "rules",
]
json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["int8", "int4", "fp8", "qt", "ptq", ".*", "(", "absmax", "fixed,1",
                       "fixed,nan", "minmax,2", "rms,x", "uniform", "dot_general", "einsum"])
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=4), inner, max_size=5),
    max_leaves=20,
)


def first_match(rule_list, path, op):
    """Brute force: the index of the first rule whose op and path match.

    A path with no ``/`` but a ``.`` is a dotted path (documented in
    normalize_module_path): ``b.1`` is ``b/1``.
    """
    if "/" not in path and "." in path:
        path = path.replace(".", "/")
    for i, rule in enumerate(rule_list):
        names = rule.op_names
        op_ok = not names or op in names or (op == "einsum" and "dot_general" in names)
        if op_ok and re.fullmatch(rule.module_path, path):
            return i
    return None


@fuzz(300, rule_list=st.lists(rules, max_size=8), path=paths, op=st.sampled_from(OPS))
def test_resolve_and_explain_agree_with_brute_force(rule_list, path, op):
    """resolve() and explain() pick the brute-force first match (or None),
    for a list and a tuple of the same rules, cached or not."""
    expected = first_match(rule_list, path, op)
    for quant in (rule_list, tuple(rule_list), list(rule_list)):
        res = qr.resolve(quant, module_path=path, op=op)
        assert (res.index if res else None) == expected
        if res is not None:
            assert res.rule == rule_list[expected]
    assert qr.explain(rule_list, module_path=path, op=op).resolution == res


@fuzz(300, rule_list=st.lists(rules, max_size=6), path=paths, op=st.sampled_from(OPS))
def test_lint_flags_only_unselectable_rules(rule_list, path, op):
    """A rule lint() calls unreachable or duplicate is never the one resolve()
    selects, and a dead rule (no op matches) is never selected for that op."""
    issues = qr.lint(rule_list)
    flagged = {i.index for i in issues if i.kind in ("unreachable", "duplicate")}
    res = qr.resolve(rule_list, module_path=path, op=op)
    if res is not None:
        assert res.index not in flagged
    for issue in issues:
        assert 0 <= issue.index < len(rule_list)
        assert issue.shadowed_by is None or issue.shadowed_by < issue.index


@fuzz(300, fields=st.dictionaries(st.sampled_from(FIELD_NAMES[:17]), json_values, max_size=4))
def test_rule_construction_is_valid_or_rule_error(fields):
    """Rule(**fields) with arbitrary field values builds a rule whose dict
    form rebuilds an equal rule, or raises a QuantRulesError."""
    try:
        rule = Rule(**fields)
    except qr.QuantRulesError:
        return
    again = qr.rule_from_dict(json.loads(json.dumps(qr.rule_to_dict(rule))))
    assert again == rule


@fuzz(300, data=json_values)
def test_config_from_json_is_valid_or_config_error(data, tmp_path):
    """rules_from_config / load_rules on any JSON value return rules that round-trip through rules_to_config, or raise a
    QuantRulesError; nothing else escapes."""
    try:
        loaded = qr.rules_from_config(data)
    except qr.QuantRulesError:
        loaded = None
    if loaded is not None:
        assert qr.rules_from_config(qr.rules_to_config(loaded)) == loaded
    path = tmp_path / "rules.json"
    blob = json.dumps(data).encode()
    path.write_bytes(blob)
    try:
        from_file = qr.load_rules(path)
    except qr.QuantRulesError:
        return
    assert from_file == qr.rules_from_config(json.loads(blob))


@fuzz(200, blob=st.binary(max_size=200))
def test_load_rules_on_arbitrary_bytes(blob, tmp_path):
    """load_rules on arbitrary bytes (invalid UTF-8, truncated JSON, deep
    nesting) returns rules or raises a ConfigError."""
    path = tmp_path / "rules.json"
    path.write_bytes(blob)
    with contextlib.suppress(qr.ConfigError):
        qr.load_rules(path)
