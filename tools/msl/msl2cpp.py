"""Preprocess Metal Shading Language kernels into C++ for the CPU harness.

    python msl2cpp.py kernels.metal out.cpp

The kernel bodies are kept as written; only what C++ cannot parse changes:
* ``#include <metal_stdlib>`` becomes ``#include "msl_shim.h"``;
* ``kernel void name(params)`` loses ``kernel`` and its parameter attributes,
  and a launcher is generated that binds ``[[buffer(i)]]``,
  ``[[threadgroup(i)]]`` and the builtins from the lane context, plus a
  registration under the kernel's name;
* ``threadgroup T name[N];`` (or a scalar ``threadgroup T name;``) declared
  inside a kernel becomes a reference to storage shared by the threadgroup (``threadgroup`` alone means nothing to
  C++, and a plain local would be private to each thread).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

BUILTINS = {
    "thread_position_in_grid": "position_in_grid",
    "thread_position_in_threadgroup": "thread_in_group",
    "threadgroup_position_in_grid": "group",
    "threads_per_threadgroup": "group_size",
    "threadgroups_per_grid": "groups",
    "thread_index_in_threadgroup": "index_in_group",
    "thread_index_in_simdgroup": "simd_lane",
    "simdgroup_index_in_threadgroup": "simd_group",
    "threads_per_simdgroup": "simd_size",
}
SCALAR_BUILTINS = {"thread_index_in_threadgroup", "thread_index_in_simdgroup",
                   "simdgroup_index_in_threadgroup", "threads_per_simdgroup"}  # fmt: skip

KERNEL = re.compile(r"\bkernel\s+void\s+(\w+)\s*\(")
TG_ARRAY = re.compile(r"^(\s*)threadgroup\s+([\w:<>, ]+?)\s+(\w+)\s*((?:\[[^\]]+\])*)\s*;", re.M)


class MslError(ValueError):
    """The source uses something the harness does not support."""


def _split_params(text: str) -> list[str]:
    params, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        elif ch == "," and depth == 0:
            params.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    if tail:
        params.append(tail)
    return params


def _matching_paren(src: str, open_index: int) -> int:
    depth = 0
    for i in range(open_index, len(src)):
        if src[i] == "(":
            depth += 1
        elif src[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise MslError("unbalanced parentheses in a kernel signature")


def _binding(param: str, kernel: str) -> tuple[str, str]:
    """(declaration without attributes, launcher argument expression)."""
    match = re.search(r"\[\[\s*(\w+)(?:\s*\(\s*(\d+)\s*\))?\s*\]\]", param)
    if not match:
        raise MslError(f"{kernel}: parameter '{param}' has no [[...]] binding")
    decl = (param[: match.start()] + param[match.end() :]).strip()
    kind, index = match.group(1), match.group(2)
    name = re.findall(r"\w+", decl)[-1]
    ctype = decl[: decl.rfind(name)].strip()
    if kind == "buffer":
        if ctype.endswith("&"):
            base = ctype[:-1].strip()
            return decl, f"*static_cast<{base}*>(::msl::detail::buffer({index}))"
        return decl, f"static_cast<{ctype}>(::msl::detail::buffer({index}))"
    if kind == "threadgroup":
        return decl, f"static_cast<{ctype}>(::msl::detail::threadgroup_buffer({index}))"
    if kind in BUILTINS:
        field = f"::msl::detail::lane().{BUILTINS[kind]}"
        if kind in SCALAR_BUILTINS:
            return decl, f"static_cast<{ctype}>({field})"
        if re.search(r"\b(u?int|ushort|short)3\b", ctype) or "uint3" in ctype:
            return decl, f"{ctype}({field}.x, {field}.y, {field}.z)"
        if "2" in ctype:
            return decl, f"{ctype}({field}.x, {field}.y)"
        return decl, f"static_cast<{ctype}>({field}.x)"
    raise MslError(f"{kernel}: unsupported attribute [[{kind}]]")


def translate(src: str) -> str:
    """The C++ translation unit for one MSL source."""
    src = re.sub(r"#include\s*<metal_\w+>", '#include "msl_shim.h"', src)
    if '#include "msl_shim.h"' not in src:
        src = '#include "msl_shim.h"\n' + src
    launchers = []
    out, pos = [], 0
    for match in KERNEL.finditer(src):
        name = match.group(1)
        open_paren = match.end() - 1
        close = _matching_paren(src, open_paren)
        decls, args = zip(
            *(_binding(p, name) for p in _split_params(src[open_paren + 1 : close])), strict=True
        )
        out.append(src[pos : match.start()])
        out.append(f"void {name}({', '.join(decls)})")
        pos = close + 1
        launchers.append(
            f"static void {name}__launch() {{ {name}({', '.join(args)}); }}\n"
            f'static ::msl::Registration {name}__registration("{name}", &{name}__launch);\n'
        )
    out.append(src[pos:])
    body = "".join(out)
    counter = iter(range(1, 1 << 30))

    def shared(m: re.Match) -> str:
        indent, ctype, name, dims = m.groups()
        t = f"{ctype.strip()}{dims}"
        site = next(counter)
        pointer = f"{ctype.strip()} (*){dims}" if dims else f"{ctype.strip()}*"
        return (
            f"{indent}auto& {name} = *static_cast<{pointer}>("
            f"::msl::detail::threadgroup_var({site}, sizeof({t}), alignof({ctype.strip()})));"
        )

    body = TG_ARRAY.sub(shared, body)
    return "// Generated by tools/msl/msl2cpp.py; do not edit.\n" + body + "\n" + "".join(launchers)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    Path(argv[2]).write_text(translate(Path(argv[1]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
