"""Rules and providers to and from plain dicts / JSON (config files)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from quantrules._errors import ConfigError, QuantRulesError
from quantrules._providers import PtqProvider, QtProvider
from quantrules._rules import Rule

__all__ = ["dump_rules", "load_rules", "rule_from_dict", "rule_to_dict", "rules_from_config",
           "rules_to_config"]

_FIELDS = {f.name: f for f in dataclasses.fields(Rule)}
_PROVIDERS = {"ptq": PtqProvider, "qt": QtProvider}


def rule_to_dict(rule: Rule) -> dict[str, Any]:
    """The rule's non-default fields as a JSON-ready dict.

    >>> rule_to_dict(Rule(module_path="enc/.*", weight_qtype="int4", tile_size=64))
    {'module_path': 'enc/.*', 'weight_qtype': 'int4', 'tile_size': 64}
    """
    out: dict[str, Any] = {}
    for name, field in _FIELDS.items():
        value = getattr(rule, name)
        if value != field.default:
            if isinstance(value, tuple):
                value = list(value)
            elif name == "additional_qt_config":
                value = dict(value)
            out[name] = value
    return out


def rule_from_dict(data: Any, *, where: str = "rule") -> Rule:
    """Build a rule from a dict, naming ``where`` and the field on error.

    >>> rule_from_dict({"weight_qtype": "int8", "op_names": ["einsum"]}).op_names
    ('einsum',)
    >>> rule_from_dict({"weight_qtyp": "int8"}, where="rules[3]")
    Traceback (most recent call last):
    ...
    quantrules._errors.ConfigError: rules[3]: unknown field 'weight_qtyp'; expected some of module_path, op_names, weight_qtype, act_qtype, bwd_qtype, tile_size, weight_calibration_method, act_calibration_method, act_batch_axes, act_static_scale, mode, bwd_calibration_method, bwd_weight_grad_tile_size, disable_channelwise_axes, bwd_stochastic_rounding, channelwise_noise_axes, additional_qt_config
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object of rule fields, got {type(data).__name__}")
    for key in data:
        if key not in _FIELDS:
            raise ConfigError(
                f"{where}: unknown field {key!r}; expected some of {', '.join(_FIELDS)}"
            )
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    try:
        return Rule(**kwargs)
    except QuantRulesError as e:
        raise ConfigError(f"{where}: {e}") from None


def rules_to_config(quant: Rule | list[Rule] | tuple[Rule, ...] | PtqProvider | QtProvider,
                    ) -> dict[str, Any]:
    """A provider or rule list as ``{"provider": "ptq"|"qt"|None, "rules": [...]}``."""
    if isinstance(quant, PtqProvider | QtProvider):
        return {"provider": quant.mode, "rules": [rule_to_dict(r) for r in quant.rules]}
    rules = (quant,) if isinstance(quant, Rule) else tuple(quant)
    return {"provider": None, "rules": [rule_to_dict(r) for r in rules]}


def rules_from_config(data: Any, *, source: str = "config",
                      ) -> tuple[Rule, ...] | PtqProvider | QtProvider:
    """Inverse of :func:`rules_to_config`; a bare list of rule dicts is accepted.

    >>> cfg = rules_to_config(QtProvider([Rule(weight_qtype="int8", mode="qt")]))
    >>> rules_from_config(cfg) == QtProvider([Rule(weight_qtype="int8", mode="qt")])
    True
    """
    provider = None
    if isinstance(data, dict):
        unknown = set(data) - {"provider", "rules"}
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {sorted(unknown)}; expected 'provider', "
                              "'rules'")
        provider = data.get("provider")
        if provider not in (None, *_PROVIDERS):
            raise ConfigError(f"{source}: provider must be null, 'ptq' or 'qt', got {provider!r}")
        data = data.get("rules")
    if not isinstance(data, list):
        raise ConfigError(f"{source}: 'rules' must be a list of rule objects")
    rules = tuple(rule_from_dict(d, where=f"{source}: rules[{i}]") for i, d in enumerate(data))
    return _PROVIDERS[provider](rules) if provider else rules


def dump_rules(quant: Rule | list[Rule] | tuple[Rule, ...] | PtqProvider | QtProvider,
               path: str | os.PathLike[str]) -> None:
    """Write rules (or a provider) to a JSON file."""
    with open(path, "w") as f:
        json.dump(rules_to_config(quant), f, indent=2)
        f.write("\n")


def load_rules(path: str | os.PathLike[str]) -> tuple[Rule, ...] | PtqProvider | QtProvider:
    """Read rules (or a provider) from a JSON file; errors name the file, index and field."""
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name}: not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: not UTF-8 text: {e}") from None
    except RecursionError:
        raise ConfigError(f"{name}: JSON nested too deeply") from None
    return rules_from_config(data, source=name)
