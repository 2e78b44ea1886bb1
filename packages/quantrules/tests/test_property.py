"""resolve() against a brute-force first-match reference on random inputs."""

import re

from hypothesis import given, settings
from hypothesis import strategies as st

import quantrules as qr
from quantrules import Rule

SEGMENTS = ["enc", "dec", "block0", "block1", "conv", "head", "attn", "mlp"]
OPS = ["dot_general", "einsum", "conv_general_dilated", "sparse_conv"]
PATTERNS = [".*", "enc/.*", "dec/.*", ".*/conv", "block[01]/.*", "head", "(enc|dec)/block0/.*",
            ".*attn.*", "enc", "", ".+/mlp"]
QTYPES = [None, "int8", "int4", "fp8"]

paths = st.lists(st.sampled_from(SEGMENTS), min_size=0, max_size=4).map("/".join)
rules = st.builds(
    Rule,
    module_path=st.one_of(st.sampled_from(PATTERNS), paths.map(re.escape)),
    op_names=st.lists(st.sampled_from(OPS), max_size=2, unique=True).map(tuple),
    weight_qtype=st.sampled_from(QTYPES),
    act_qtype=st.sampled_from(QTYPES),
)


def reference(rule_list, path, op):
    for i, rule in enumerate(rule_list):
        names = rule.op_names
        op_ok = not names or op in names or (op == "einsum" and "dot_general" in names)
        if op_ok and re.fullmatch(rule.module_path, path):
            return i
    return None


@settings(max_examples=400, deadline=None)
@given(st.lists(rules, max_size=8), paths, st.sampled_from(OPS), st.booleans())
def test_resolve_matches_brute_force(rule_list, path, op, dotted):
    query = path.replace("/", ".") if dotted else path
    res = qr.resolve(rule_list, module_path=query, op=op)
    expected = reference(rule_list, path, op)
    assert (res.index if res else None) == expected
    if res is not None:
        assert res.rule == rule_list[expected]
        assert res.disabled == (res.rule.weight_qtype is None and res.rule.act_qtype is None)
    again = qr.resolve(list(rule_list), module_path=query, op=op)
    assert again == res
    assert qr.explain(rule_list, module_path=query, op=op).resolution == res


@settings(max_examples=200, deadline=None)
@given(st.lists(rules, max_size=6), paths, st.sampled_from(OPS))
def test_lint_never_reports_a_reachable_rule(rule_list, path, op):
    """Soundness: a rule that resolve() can select is never called unreachable."""
    flagged = {i.index for i in qr.lint(rule_list) if i.kind in ("unreachable", "duplicate")}
    res = qr.resolve(rule_list, module_path=path, op=op)
    if res is not None:
        assert res.index not in flagged
