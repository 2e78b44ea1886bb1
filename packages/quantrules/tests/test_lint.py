import quantrules as qr
from quantrules import Rule


def kinds(issues):
    return [(i.index, i.kind, i.shadowed_by) for i in issues]


def test_clean_rules_have_no_issues():
    rules = [Rule(module_path="enc/conv1", weight_qtype="int4"),
             Rule(module_path="enc/.*", weight_qtype="int8"),
             Rule(weight_qtype="int8", op_names=("einsum",))]
    assert qr.lint(rules) == []


def test_shadowed_by_match_all_and_prefix():
    rules = [Rule(module_path="enc/.*", weight_qtype="int8"),
             Rule(module_path="enc/block/.*", weight_qtype="int4"),
             Rule(module_path="enc/conv", weight_qtype="int4"),
             Rule(weight_qtype="int8"),
             Rule(module_path="dec/.*", op_names=("einsum",), weight_qtype="int4")]
    assert kinds(qr.lint(rules)) == [(1, "unreachable", 0), (2, "unreachable", 0),
                                     (4, "unreachable", 3)]


def test_op_coverage_matters_for_shadowing():
    rules = [Rule(op_names=("dot_general",), weight_qtype="int8"),
             Rule(op_names=("einsum",), weight_qtype="int4"),       # dot_general covers einsum
             Rule(op_names=("conv_general_dilated",), weight_qtype="int4")]
    assert kinds(qr.lint(rules)) == [(1, "unreachable", 0)]
    rules = [Rule(op_names=("einsum",), weight_qtype="int8"),
             Rule(op_names=("dot_general",), weight_qtype="int4")]  # still reachable for dot_general
    assert qr.lint(rules) == []


def test_duplicates_and_dead_rules():
    rules = [Rule(module_path="a", weight_qtype="int8"),
             Rule(module_path="a", weight_qtype="int8"),
             Rule(op_names=("sparse_conv",), weight_qtype="int8")]
    issues = qr.lint(rules, ops=("dot_general", "einsum", "conv_general_dilated"))
    assert kinds(issues) == [(1, "duplicate", 0), (2, "dead", None)]
    assert str(issues[1]).startswith("rule #2: dead: op_names ('sparse_conv',)")


def test_regex_rules_are_not_falsely_reported():
    rules = [Rule(module_path="enc/[0-9]+", weight_qtype="int8"),
             Rule(module_path="enc/x", weight_qtype="int4"),
             Rule(module_path="enc/1", weight_qtype="int4")]
    # 'enc/x' is not matched by 'enc/[0-9]+'; 'enc/1' is (literal test against the regex).
    assert kinds(qr.lint(rules)) == [(2, "unreachable", 0)]


def test_lint_accepts_providers():
    provider = qr.QtProvider([Rule(weight_qtype="int8"), Rule(weight_qtype="int4")])
    assert kinds(qr.lint(provider)) == [(1, "unreachable", 0)]
