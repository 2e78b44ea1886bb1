"""Every private Qwix 0.1.8 import of taktiny_ops, in one place.

Qwix's providers need a Flax module context, so stateless ops do their own
rule matching and call Qwix's core directly, exactly as its providers do;
that keeps results bitwise equal to Qwix's own model path. Qwix is pinned
exactly in the lock because these names are not public API.
"""

from __future__ import annotations

from qwix._src.core import conv_general as conv_general_core
from qwix._src.core import conv_general_qt, dot_general_qt, qarray
from qwix._src.core import dot_general as dot_general_core
from qwix._src.core import einsum as einsum_core

__all__ = [
    "ConvGeneralQtConfig",
    "DotGeneralQtConfig",
    "conv_general_qt",
    "conv_how",
    "dot_general_qt",
    "dot_how",
    "einsum_how",
    "quantize",
]

DotGeneralQtConfig = dot_general_qt.DotGeneralQtConfig
ConvGeneralQtConfig = conv_general_qt.ConvGeneralQtConfig
dot_how = dot_general_core.get_how_to_quantize
einsum_how = einsum_core.get_how_to_quantize
conv_how = conv_general_core.get_how_to_quantize
quantize = qarray.quantize
conv_general_qt = conv_general_qt.conv_general_qt
dot_general_qt = dot_general_qt.dot_general_qt
