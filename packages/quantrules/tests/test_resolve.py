import subprocess
import sys

import pytest

import quantrules as qr
from quantrules import PtqProvider, QtProvider, Rule


def test_none_resolves_to_none():
    assert qr.resolve(None, op="dot_general") is None


@pytest.mark.parametrize(("name", "tile"), [("int4", 128), ("uint4", 128), ("nf4", 128),
                                            ("int8", None), ("fp8", None), ("mxfp4", None)])
def test_string_shorthand_is_weight_only_every_op(name, tile):
    for op in ("dot_general", "einsum", "conv_general_dilated", "sparse_conv"):
        res = qr.resolve(name, module_path="any/where", op=op)
        assert res.index == 0 and res.mode == "ptq"
        assert res.rule.weight_qtype == qr.get_qtype(name).name
        assert res.rule.act_qtype is None and res.rule.tile_size == tile


def test_bad_string_names_the_qtype():
    with pytest.raises(qr.UnknownQTypeError, match="int9"):
        qr.resolve("int9", op="dot_general")


def test_single_rule_and_first_match_order():
    a = Rule(module_path="enc/.*", weight_qtype="int8")
    b = Rule(weight_qtype="int4", tile_size=32)
    assert qr.resolve(a, module_path="enc/x", op="einsum").rule is a
    assert qr.resolve(a, module_path="dec/x", op="einsum") is None
    for seq in ([a, b], (a, b)):
        assert qr.resolve(seq, module_path="enc/x", op="dot_general").index == 0
        assert qr.resolve(seq, module_path="dec/x", op="dot_general").index == 1


def test_fullmatch_semantics():
    rules = [Rule(module_path="enc", weight_qtype="int8")]
    assert qr.resolve(rules, module_path="enc", op="dot_general") is not None
    assert qr.resolve(rules, module_path="enc/sub", op="dot_general") is None
    assert qr.resolve(rules, module_path="xenc", op="dot_general") is None


def test_dot_joined_path_is_normalized():
    rules = [Rule(module_path="encoder/block1/conv", weight_qtype="int8")]
    assert qr.resolve(rules, module_path="encoder.block1.conv", op="sparse_conv").index == 0
    assert qr.normalize_module_path("a/b.c") == "a/b.c"


def test_disabling_rule_stops_search():
    rules = [Rule(module_path="head"), Rule(weight_qtype="int8")]
    res = qr.resolve(rules, module_path="head", op="dot_general")
    assert res.index == 0 and res.disabled
    assert not qr.resolve(rules, module_path="body", op="dot_general").disabled


def test_einsum_matches_dot_general_rules():
    rules = [Rule(op_names=("conv_general_dilated",), weight_qtype="int4"),
             Rule(op_names=("dot_general",), weight_qtype="int8")]
    assert qr.resolve(rules, op="einsum").index == 1
    assert qr.resolve(rules, op="sparse_conv") is None


def test_modes_of_rules_and_providers():
    plain = Rule(weight_qtype="int8")
    qt = Rule(weight_qtype="int8", mode="qt", bwd_qtype="int8")
    assert qr.resolve(plain, op="dot_general").mode == "ptq"
    assert qr.resolve(qt, op="dot_general").mode == "qt"
    assert qr.resolve(PtqProvider([qt]), op="dot_general").mode == "ptq"
    assert qr.resolve(QtProvider([plain]), op="dot_general").mode == "qt"
    assert qr.resolve(PtqProvider(plain), op="dot_general").rule is plain


def test_provider_rejects_foreign_rules():
    with pytest.raises(qr.RuleError, match=r"PtqProvider.rules\[1\]: expected a quantrules.Rule"):
        PtqProvider([Rule(), "int8"])


def test_bad_quant_and_op():
    with pytest.raises(qr.QuantRulesError, match="quant: expected None, a qtype string"):
        qr.resolve(3.5, op="dot_general")
    with pytest.raises(qr.QuantRulesError, match=r"quant\[1\]: expected a quantrules.Rule"):
        qr.resolve([Rule(), {"weight_qtype": "int8"}], op="dot_general")
    with pytest.raises(qr.UnknownOpError, match="op: unknown op 'matmul'"):
        qr.resolve("int8", op="matmul")
    with pytest.raises(qr.QuantRulesError, match="module_path: expected a string"):
        qr.resolve("int8", module_path=3, op="einsum")


def test_cache_hits_and_never_goes_stale():
    rules = [Rule(module_path="a.*", weight_qtype="int8"), Rule(weight_qtype="int4")]
    first = qr.resolve(rules, module_path="abc", op="einsum")
    assert qr.resolve(rules, module_path="abc", op="einsum") is first  # served from cache
    assert qr.resolve(tuple(rules), module_path="abc", op="einsum") == first
    rules.insert(0, Rule(module_path="abc"))  # mutating the list must not serve stale results
    assert qr.resolve(rules, module_path="abc", op="einsum").disabled
    rules[0] = Rule(module_path="abc", weight_qtype="fp8")
    assert qr.resolve(rules, module_path="abc", op="einsum").rule.weight_qtype == "float8_e4m3fn"


def test_explain_trace():
    rules = [Rule(module_path="enc/.*", op_names=("conv_general_dilated",), weight_qtype="int8"),
             Rule(module_path="dec/.*", weight_qtype="int8"),
             Rule(module_path="enc/.*", act_qtype="int8", weight_qtype="int4", tile_size=64)]
    ex = qr.explain(rules, module_path="enc.layer", op="dot_general")
    assert ex.resolution == qr.resolve(rules, module_path="enc/layer", op="dot_general")
    assert [(i, ok) for i, ok, _ in ex.steps] == [(0, False), (1, False), (2, True)]
    text = str(ex)
    assert "op 'dot_general' not in op_names ('conv_general_dilated',)" in text
    assert "module path 'enc/layer' does not fullmatch 'dec/.*'" in text
    assert "=> rule #2 (ptq): weight_qtype=int4, act_qtype=int8, tile_size=64" in text
    assert qr.explain("int8", op="einsum").source == "weight-only shorthand 'int8'"
    assert "disables quantization" in qr.explain([Rule()], op="einsum").summary


def test_import_needs_no_framework():
    code = (
        "import sys, quantrules as qr\n"
        "qr.resolve([qr.Rule(weight_qtype='int8')], module_path='a', op='einsum')\n"
        "qr.explain('int4', op='sparse_conv'); qr.lint([qr.Rule()])\n"
        "bad = [m for m in ('jax', 'mlx', 'qwix', 'flax', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
