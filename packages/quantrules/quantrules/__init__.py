"""Framework-neutral quantization rule resolution.

``quantrules`` decides *which* op is quantized and *how*; back-ends
(``taktiny_ops`` for JAX + Qwix, ``mlx_lattice`` for MLX) do the arithmetic.
It imports neither JAX nor MLX; the Qwix adapter imports Qwix lazily.

>>> import quantrules as qr
>>> rules = [qr.Rule(module_path="head/.*", weight_qtype=None),
...          qr.Rule(weight_qtype="int4", tile_size=64)]
>>> qr.resolve(rules, module_path="encoder.layer0", op="dot_general").rule.weight_qtype
'int4'
"""

from quantrules._config import (
    dump_rules,
    load_rules,
    rule_from_dict,
    rule_to_dict,
    rules_from_config,
    rules_to_config,
)
from quantrules._errors import (
    ConfigError,
    QuantRulesError,
    RuleError,
    UnknownOpError,
    UnknownQTypeError,
    UnsupportedQTypeError,
)
from quantrules._lint import LintIssue, lint
from quantrules._ops import known_ops, register_op
from quantrules._providers import PtqProvider, QtProvider
from quantrules._qtypes import QType, get_qtype, qtype_names
from quantrules._qwix import from_qwix, qwix_qtype, to_qwix
from quantrules._resolve import (
    Explanation,
    Resolution,
    as_rules,
    explain,
    normalize_module_path,
    resolve,
    weight_only,
)
from quantrules._rules import Mode, Rule
from quantrules._version import __version__

__all__ = [
    "ConfigError",
    "Explanation",
    "LintIssue",
    "Mode",
    "PtqProvider",
    "QType",
    "QtProvider",
    "QuantRulesError",
    "Resolution",
    "Rule",
    "RuleError",
    "UnknownOpError",
    "UnknownQTypeError",
    "UnsupportedQTypeError",
    "__version__",
    "as_rules",
    "dump_rules",
    "explain",
    "from_qwix",
    "get_qtype",
    "known_ops",
    "lint",
    "load_rules",
    "normalize_module_path",
    "qtype_names",
    "qwix_qtype",
    "register_op",
    "resolve",
    "rule_from_dict",
    "rule_to_dict",
    "rules_from_config",
    "rules_to_config",
    "to_qwix",
    "weight_only",
]
