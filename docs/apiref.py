"""The API reference: which names are public, their docstrings, and the pages.

A module is public when no part of its dotted name starts with ``_``; its
public names are its ``__all__``. Every public module of every package gets
one page (``api/<module>.rst``) with an entry for each name, so the site's
object inventory holds ``<module>.<name>`` for all of them. ``conf.py`` calls
:func:`write_pages` before Sphinx reads the sources; ``docs_test.py`` calls
:func:`entries`, :func:`undocumented` and :func:`missing_from` against the
built site.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pkgutil
import sys

__all__ = ["PACKAGES", "Entry", "entries", "missing_from", "public_modules", "undocumented", "write_pages"]

#: The packages whose API the site documents.
PACKAGES = ("quantrules", "taktiny_ops", "mlx_lattice")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One public name: where it is public, what it is, its docstring."""

    module: str
    name: str
    kind: str  # "module" | "class" | "exception" | "function" | "data"
    doc: str | None

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


def public_modules(package: str) -> list[str]:
    """The package and its public submodules, imported, in walk order."""
    top = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(top.__path__, package + "."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    for name in names:
        importlib.import_module(name)
    return names


def _own_doc(obj: object) -> str | None:
    """The object's own docstring: not its type's (a callable instance such
    as ``mx.custom_function`` reports its class's) and not a base class's
    (which ``inspect.getdoc`` would return)."""
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or (not inspect.isclass(obj) and doc is type(obj).__doc__):
        return None
    return inspect.cleandoc(doc)


def _kind(obj: object) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if callable(obj) and type(obj).__module__ != "typing":  # Literal[...] aliases are data
        return "function"
    return "data"  # constants and type aliases: documented by a `#:` comment


def _attribute_doc(package: str, name: str, obj: object) -> str | None:
    """The `#:` comment (or string after the assignment) of a data name.

    Searched in every loaded module of the package that binds ``name`` to
    this very object, so a constant re-exported by ``__init__`` keeps the
    comment written where it is defined.
    """
    from sphinx.errors import PycodeError
    from sphinx.pycode import ModuleAnalyzer

    for modname, mod in sorted(sys.modules.items()):
        if mod is None or not (modname == package or modname.startswith(package + ".")):
            continue
        if getattr(mod, name, _MISSING) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except PycodeError:  # no source (a native module)
            continue
        lines = docs.get(("", name))
        if lines and "".join(lines).strip():
            return "\n".join(lines).strip()
    return None


_MISSING = object()


def entries(module: str) -> list[Entry]:
    """The public names of ``module`` (its ``__all__``) with their docstrings.

    Raises:
        ValueError: the module has no ``__all__``, or names one it lacks.
    """
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    if names is None:
        raise ValueError(f"{module}: a public module must define __all__")
    out = []
    package = module.split(".")[0]
    for name in names:
        if not hasattr(mod, name):
            raise ValueError(f"{module}.__all__ names {name!r}, which the module does not define")
        obj = getattr(mod, name)
        kind = _kind(obj)
        doc = _attribute_doc(package, name, obj) if kind == "data" else _own_doc(obj)
        out.append(Entry(module, name, kind, doc.strip() if doc and doc.strip() else None))
    return out


def undocumented(items: list[Entry]) -> list[str]:
    """The qualified names among ``items`` that have no docstring."""
    return [e.qualname for e in items if e.doc is None]


def missing_from(items: list[Entry], inventory: set[str]) -> list[str]:
    """The qualified names among ``items`` that the site's inventory lacks."""
    return [e.qualname for e in items if e.qualname not in inventory]


def _module_directive(module: str) -> str:
    """``py:module``, or ``py:currentmodule`` where the parent package binds
    the same name to another object (``mlx_lattice.quantize``, the function,
    shadows the module of that name), which would otherwise be a duplicate."""
    parent, _, last = module.rpartition(".")
    if parent and getattr(sys.modules[parent], last, None) is not sys.modules[module]:
        return f".. py:currentmodule:: {module}"
    return f".. py:module:: {module}"


def _indent(text: str, prefix: str = "   ") -> str:
    return "\n".join(prefix + line if line else "" for line in text.splitlines())


def _page(module: str) -> str:
    mod = sys.modules[module]
    title = f"``{module}``"
    lines = [title, "=" * len(title), "", _module_directive(module), ""]
    doc = inspect.getdoc(mod)
    if doc:
        lines += [doc, ""]
    for e in entries(module):
        if e.kind == "module":
            target = getattr(mod, e.name).__name__
            # A public submodule of the same name has its own page, which
            # declares it; here it is only a link.
            own_page = target == f"{module}.{e.name}" and not target.split(".")[-1].startswith("_")
            lines += [f".. py:data:: {e.name}"] + (["   :no-index:"] if own_page else [])
            lines += ["", f"   The module :py:mod:`{target}`.", ""]
            if e.doc:
                lines += [_indent(e.doc.split("\n\n")[0]), ""]
        elif e.kind == "data":
            lines += [f".. py:data:: {e.name}", ""]
            if e.doc:
                lines += [_indent(e.doc), ""]
        elif e.kind == "class":
            lines += [f".. autoclass:: {e.name}", "   :members:", "   :show-inheritance:", ""]
        elif e.kind == "exception":
            lines += [f".. autoexception:: {e.name}", "   :show-inheritance:", ""]
        else:
            lines += [f".. autofunction:: {e.name}", ""]
    return "\n".join(lines) + "\n"


def write_pages(dest: str) -> list[str]:
    """Write ``dest/index.rst`` and one page per public module; returns the modules."""
    os.makedirs(dest, exist_ok=True)
    modules = [m for package in PACKAGES for m in public_modules(package)]
    for module in modules:
        with open(os.path.join(dest, module + ".rst"), "w") as f:
            f.write(_page(module))
    index = [
        "API reference",
        "=============",
        "",
        "Generated from the docstrings: one page per public module (no part of",
        "its name starts with ``_``), one entry per name in its ``__all__``. A",
        "name that a package re-exports from one of its public modules appears",
        "on both pages.",
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "",
    ]
    index += [f"   {module}" for module in modules]
    with open(os.path.join(dest, "index.rst"), "w") as f:
        f.write("\n".join(index) + "\n")
    return modules
