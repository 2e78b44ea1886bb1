"""The wheels can be published: twine's metadata check and, for native wheels,
auditwheel's symbol analysis against the manylinux tag the wheel carries.

auditwheel leaves one external library allowed: libmlx.so, which the `mlx`
wheel provides (the extension's rpath points into site-packages/mlx/lib), so
`overall_tag` stays linux_x86_64 while `sym_tag` is what the tag rests on.

Besides auditwheel's verdict, every versioned symbol each shared library in
the wheel references (its ELF version needs: GLIBC_*, GLIBCXX_*, CXXABI_*,
GCC_*) is checked against the symbol versions auditwheel's own policy file
(`manylinux-policy.json`) allows for the tag the wheel carries; the check is
first run on synthetic version lists, which it must accept and refuse.
And no symbol may be taken unversioned from a system library that exports
it versioned on the test's machine: a reference the library linked against
did not define (say __cxa_call_terminate, CXXABI_1.3.15, which GCC 14 and
newer emit, against GCC 12's libstdc++) keeps no version, escapes both
checks above, and fails to load where the library is that old.
Nor may a library define a symbol of the C++ runtime's own namespace
(__cxa_*, __gxx_*, in .symtab or .dynsym, hidden or not): the runtime
belongs to the compiler's libstdc++, and a copy in the product means the
extension was built by a compiler whose runtime is not the one it links.

    wheel_audit_test.py WHEEL...
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import zipfile
from importlib import resources

from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection, GNUVerSymSection
from elftools.elf.sections import SymbolTableSection

ALLOWED_EXTERNAL = {"libmlx.so"}
# The version namespaces of the system libraries a manylinux policy covers
# (glibc, libstdc++, its C++ ABI, libgcc_s); others (libmlx.so has none) are
# not the policy's to judge.
CHECKED_PREFIXES = ("GLIBC", "GLIBCXX", "CXXABI", "GCC")


def glibc_minor(tag: str) -> int:
    found = re.search(r"manylinux_2_(\d+)_", tag)
    if not found:
        raise ValueError(f"not a manylinux_2_x tag: {tag!r}")
    return int(found.group(1))


def policy_symbol_versions(tag: str, arch: str) -> dict[str, set[str]]:
    """The symbol versions auditwheel's policy file allows for manylinux tag
    `tag` (e.g. "manylinux_2_35") on `arch`: {"GLIBC": {"2.2.5", ...}, ...}."""
    text = resources.files("auditwheel.policy").joinpath("manylinux-policy.json").read_text()
    for policy in json.loads(text):
        if tag == policy["name"] or tag in policy["aliases"]:
            return {prefix: set(versions) for prefix, versions in policy["symbol_versions"][arch].items()}
    raise ValueError(f"auditwheel's manylinux policy has no {tag!r}")


def policy_libraries(tag: str) -> set[str]:
    """The system libraries auditwheel's policy for `tag` lets a wheel use."""
    text = resources.files("auditwheel.policy").joinpath("manylinux-policy.json").read_text()
    for policy in json.loads(text):
        if tag == policy["name"] or tag in policy["aliases"]:
            return set(policy["lib_whitelist"])
    raise ValueError(f"auditwheel's manylinux policy has no {tag!r}")


def disallowed_versions(referenced: set[str], allowed: dict[str, set[str]]) -> list[str]:
    """The versions in `referenced` ("GLIBC_2.38", ...) of a checked namespace
    that `allowed` (policy_symbol_versions) does not list, sorted."""
    bad = []
    for name in referenced:
        prefix, _, version = name.partition("_")
        if prefix in CHECKED_PREFIXES and version not in allowed.get(prefix, set()):
            bad.append(name)
    return sorted(bad)


def referenced_versions(elf_bytes: bytes) -> set[str]:
    """The symbol versions a shared library needs from others (.gnu.version_r)."""
    found = set()
    for section in ELFFile(io.BytesIO(elf_bytes)).iter_sections():
        if isinstance(section, GNUVerNeedSection):
            for _needed, auxiliaries in section.iter_versions():
                found.update(aux.name for aux in auxiliaries)
    return found


# Where the test's machine keeps the system libraries (x86_64 Debian and others).
LIBRARY_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64")


def dynamic_symbols(elf: ELFFile) -> list[tuple[str, bool, bool, str | None]]:
    """(name, undefined, weak, version or None) of each dynamic symbol."""
    dynsym = elf.get_section_by_name(".dynsym")
    if not isinstance(dynsym, SymbolTableSection):
        return []
    versym = next((s for s in elf.iter_sections() if isinstance(s, GNUVerSymSection)), None)
    names = {}
    for section in elf.iter_sections():
        if isinstance(section, GNUVerNeedSection):
            for _needed, auxiliaries in section.iter_versions():
                names.update({aux["vna_other"]: aux.name for aux in auxiliaries})
    symbols = []
    for index, symbol in enumerate(dynsym.iter_symbols()):
        if not symbol.name:
            continue
        version = None
        if versym is not None:
            ndx = versym.get_symbol(index)["ndx"]
            version = names.get(ndx) if isinstance(ndx, int) else None
        undefined = symbol["st_shndx"] == "SHN_UNDEF"
        symbols.append((symbol.name, undefined, symbol["st_info"]["bind"] == "STB_WEAK", version))
    return symbols


def exported_versioned(path: str) -> set[str]:
    """The names a system library exports with a symbol version."""
    with open(path, "rb") as stream:
        elf = ELFFile(stream)
        dynsym = elf.get_section_by_name(".dynsym")
        versym = next((s for s in elf.iter_sections() if isinstance(s, GNUVerSymSection)), None)
        if not isinstance(dynsym, SymbolTableSection) or versym is None:
            return set()
        return {
            symbol.name
            for index, symbol in enumerate(dynsym.iter_symbols())
            if symbol.name
            and symbol["st_shndx"] != "SHN_UNDEF"
            and versym.get_symbol(index)["ndx"] not in ("VER_NDX_LOCAL", "VER_NDX_GLOBAL", 0, 1)
        }


# The C++ runtime's own namespace (the Itanium C++ ABI's entry points and
# GCC's personality routine); "DW.ref.__gxx_personality_v0", the per-object
# pointer to the personality routine, is not a definition of it.
RUNTIME_SYMBOL = re.compile(r"__(cxa|gxx)_\w+")


def runtime_definitions(symbols: list[tuple[str, bool]]) -> list[str]:
    """The names among (name, defined) pairs that define a C++ runtime symbol, sorted."""
    return sorted({name for name, defined in symbols if defined and RUNTIME_SYMBOL.fullmatch(name)})


def defined_symbols(elf: ELFFile) -> tuple[list[tuple[str, bool]], bool]:
    """(name, defined) of every symbol in .symtab and .dynsym, and whether
    the library still has its .symtab (local and hidden symbols)."""
    symbols = []
    has_symtab = False
    for section_name in (".symtab", ".dynsym"):
        section = elf.get_section_by_name(section_name)
        if not isinstance(section, SymbolTableSection):
            continue
        has_symtab = has_symtab or section_name == ".symtab"
        for symbol in section.iter_symbols():
            if symbol.name and symbol["st_info"]["type"] != "STT_FILE":
                symbols.append((symbol.name, symbol["st_shndx"] != "SHN_UNDEF"))
    return symbols, has_symtab


def unversioned_from_system(unversioned: set[str], system: dict[str, set[str]]) -> list[str]:
    """The names in `unversioned` (strong undefined references without a
    version) that a system library exports versioned, as "name (library)"."""
    return sorted(f"{name} ({library})" for library, names in system.items() for name in unversioned & names)


def system_libraries(needed: list[str], whitelist: set[str]) -> dict[str, set[str]]:
    """library -> versioned exports, for the policy's libraries in `needed`
    found on this machine."""
    found = {}
    for library in needed:
        if library in whitelist:
            for directory in LIBRARY_DIRS:
                path = f"{directory}/{library}"
                try:
                    found[library] = exported_versioned(path)
                    break
                except FileNotFoundError:
                    continue
    return found


def check_symbol_versions(wheel: str, platform: str) -> list[str]:
    """Each shared library of `wheel` against the policy of its tag `platform`."""
    found = re.fullmatch(r"(manylinux_2_\d+)_(\w+)", platform)
    if not found:
        return [f"{wheel}: cannot read a manylinux_2_x tag and architecture from {platform!r}"]
    allowed = policy_symbol_versions(found.group(1), found.group(2))
    problems = []
    with zipfile.ZipFile(wheel) as archive:
        libraries = [n for n in archive.namelist() if re.search(r"\.so(\.|$)", n)]
        if not libraries:
            problems.append(f"{wheel}: a native wheel without a shared library")
        for name in libraries:
            data = archive.read(name)
            elf = ELFFile(io.BytesIO(data))
            needed = [tag.needed for tag in elf.get_section_by_name(".dynamic").iter_tags() if tag.entry.d_tag == "DT_NEEDED"]
            system = system_libraries(needed, policy_libraries(found.group(1)))
            unversioned = {n for n, undefined, weak, v in dynamic_symbols(elf) if undefined and not weak and v is None}
            print(f"{wheel}: {name}: {len(unversioned)} unversioned references checked against {sorted(system)}")
            symbols, has_symtab = defined_symbols(elf)
            runtime = runtime_definitions(symbols)
            print(
                f"{wheel}: {name}: {len(symbols)} symbols checked for C++ runtime definitions"
                + ("" if has_symtab else " (no .symtab: exported symbols only)")
            )
            if runtime:
                problems.append(
                    f"{wheel}: {name} defines C++ runtime symbols {runtime}: the runtime is the "
                    "compiler's libstdc++, never the product's (build with a compiler whose runtime "
                    "is the libstdc++ it links)"
                )
            escaped = unversioned_from_system(unversioned, system)
            if escaped:
                problems.append(
                    f"{wheel}: {name} takes {escaped} without a symbol version: the libraries it was "
                    "linked against lack them, older systems of its tag will not load it"
                )
            referenced = referenced_versions(data)
            checked = sorted(v for v in referenced if v.partition("_")[0] in CHECKED_PREFIXES)
            print(f"{wheel}: {name} references {', '.join(checked)}")
            bad = disallowed_versions(referenced, allowed)
            if bad:
                problems.append(f"{wheel}: {name} needs {bad}, which {found.group(1)} does not allow")
    return problems


def self_check() -> list[str]:
    """The symbol check on synthetic references: what a forky (glibc 2.43,
    GCC 16) link brings in is refused at manylinux_2_35 and accepted at
    manylinux_2_39; bookworm's newest are accepted at manylinux_2_35."""
    problems = []
    forky = {"GLIBC_2.38", "GLIBCXX_3.4.31", "CXXABI_1.3.15", "GLIBC_2.2.5", "GCC_3.0"}
    bookworm = {"GLIBC_2.35", "GLIBC_2.32", "GLIBCXX_3.4.30", "CXXABI_1.3.13", "GCC_3.0", "NOT_CHECKED_9"}
    cases = [
        (forky, "manylinux_2_35", ["CXXABI_1.3.15", "GLIBCXX_3.4.31", "GLIBC_2.38"]),
        (forky, "manylinux_2_39", []),
        (bookworm, "manylinux_2_35", []),
        (bookworm, "manylinux_2_31", ["CXXABI_1.3.13", "GLIBCXX_3.4.30", "GLIBC_2.32", "GLIBC_2.35"]),
    ]
    for referenced, tag, expected in cases:
        got = disallowed_versions(referenced, policy_symbol_versions(tag, "x86_64"))
        if got != sorted(expected):
            problems.append(f"self-check: {sorted(referenced)} at {tag}: refused {got}, expected {sorted(expected)}")
    system = {"libstdc++.so.6": {"__cxa_call_terminate", "_Znwm"}, "libc.so.6": {"strtol"}}
    escaped = unversioned_from_system({"__cxa_call_terminate", "PyList_New", "_ZN3mlx4core4evalEv"}, system)
    if escaped != ["__cxa_call_terminate (libstdc++.so.6)"]:
        problems.append(f"self-check: unversioned references: {escaped}, expected __cxa_call_terminate")
    runtime = runtime_definitions(
        [
            ("__cxa_call_terminate", True),
            ("__gxx_personality_v0", False),
            ("DW.ref.__gxx_personality_v0", True),
            ("__cxa_throw", False),
            ("_ZN3mlx4core4evalEv", True),
        ]
    )
    if runtime != ["__cxa_call_terminate"]:
        problems.append(f"self-check: runtime definitions: {runtime}, expected __cxa_call_terminate")
    if glibc_minor("manylinux_2_39_x86_64") != 39:
        problems.append("self-check: glibc_minor('manylinux_2_39_x86_64') is not 39")
    return problems


def audit(wheel: str) -> list[str]:
    platform = wheel.rsplit("-", 1)[1].removesuffix(".whl")
    if platform == "any":
        return []
    if not platform.startswith("manylinux_"):
        return [f"{wheel}: platform tag {platform!r} is not a manylinux tag"]
    shown = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", "--json", wheel],
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        return [f"{wheel}: auditwheel show failed:\n{shown.stderr}"]
    report = json.loads(shown.stdout)
    problems = []
    external = set(report["external_libs"])
    if external - ALLOWED_EXTERNAL:
        problems.append(f"{wheel}: external libraries {sorted(external - ALLOWED_EXTERNAL)}")
    if report["unsupported_isa"]:
        problems.append(f"{wheel}: auditwheel found unsupported ISA extensions")
    if glibc_minor(report["sym_tag"]) > glibc_minor(platform):
        problems.append(
            f"{wheel}: symbols need {report['sym_tag']}, tagged {platform} "
            "(raise MANYLINUX_GLIBC_MINOR in tools/wheel.bzl)"
        )
    elif glibc_minor(report["sym_tag"]) < glibc_minor(platform):
        print(f"{wheel}: this build's symbols would allow {report['sym_tag']}")
    print(
        f"{wheel}: tagged {platform}; auditwheel: symbols {report['sym_tag']}, external {sorted(external)}"
    )
    return problems + check_symbol_versions(wheel, platform)


def main(wheels: list[str]) -> int:
    problems = self_check()
    for wheel in wheels:
        problems += audit(wheel)
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *wheels])
    if checked.returncode != 0:
        problems.append("twine check --strict failed")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
