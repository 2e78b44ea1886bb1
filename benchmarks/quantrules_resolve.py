"""Benchmark: cost of quantrules.resolve(), cached and uncached.

Prints per-call microseconds for a realistic rule list (8 rules, the match in
the middle) over 64 module paths, and the ratio uncached / cached. Target:
cached under 2 µs per call.
"""

from __future__ import annotations

import platform

import quantrules as qr
from benchmarks.host_class import host_class_line
from benchmarks.timing import best_us
from quantrules import _resolve


def _rules() -> list[qr.Rule]:
    return [
        qr.Rule(module_path="head"),
        qr.Rule(module_path="embed/.*", weight_qtype="int8"),
        qr.Rule(
            module_path="encoder/[0-9]+/attn/.*",
            op_names=("einsum",),
            weight_qtype="int8",
            act_qtype="int8",
        ),
        qr.Rule(module_path="encoder/[0-9]+/mlp/.*", weight_qtype="int4", tile_size=128),
        qr.Rule(
            module_path="decoder/.*/conv",
            op_names=("conv_general_dilated",),
            weight_qtype="int8",
            act_qtype="int8",
        ),
        qr.Rule(module_path="decoder/.*", weight_qtype="int8"),
        qr.Rule(module_path=".*norm.*"),
        qr.Rule(weight_qtype="int8"),
    ]


def main() -> None:
    print(host_class_line())
    rules = _rules()
    paths = [f"encoder/{i}/mlp/fc{j}" for i in range(16) for j in range(4)]
    ops = ("dot_general", "einsum")

    def cached_list():
        for p in paths:
            qr.resolve(rules, module_path=p, op="dot_general")

    frozen = tuple(rules)

    def cached_tuple():
        for p in paths:
            qr.resolve(frozen, module_path=p, op="dot_general")

    def uncached():
        _resolve._clear_cache()
        for p in paths:
            for op in ops:
                qr.resolve(rules, module_path=p, op=op)

    cached_list()
    n = len(paths)
    t_list = best_us(cached_list, 200) / n
    t_tuple = best_us(cached_tuple, 200) / n
    t_uncached = best_us(uncached, 20) / (n * len(ops))
    print(
        f"quantrules.resolve on {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, {len(rules)} rules, {n} paths"
    )
    print(f"  cached, rules as tuple : {t_tuple:6.2f} µs/call")
    print(f"  cached, rules as list  : {t_list:6.2f} µs/call")
    print(
        f"  uncached               : {t_uncached:6.2f} µs/call "
        f"({t_uncached / t_tuple:.0f}x the cached tuple call)"
    )
    print(f"  target: cached < 2 µs -> {'met' if max(t_list, t_tuple) < 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
