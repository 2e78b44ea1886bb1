"""Quantization-aware dense ops on JAX + Qwix.

``linear``, ``einsum``, ``conv_general_dilated`` and ``dot_general`` take a
``quant`` argument (anything :mod:`quantrules` accepts) and a
``module_path``; rule resolution happens at trace time, so under
``jax.jit`` the compiled program is the same as a hand-written Qwix call.
``quantize_weight`` quantizes a weight once for them, as the PTQ layers hold
it; ``kernel=`` (``kernels=`` on ``quantize``) switches the matmul between
Qwix's program and the Pallas TPU kernels.
"""

from taktiny_ops._common import TaktinyOpsError
from taktiny_ops._conv import conv_general_dilated
from taktiny_ops._dot import dot_general, linear
from taktiny_ops._einsum import einsum
from taktiny_ops._export import FORMAT_VERSION, LOADER, ArtifactError, export_model, load_model
from taktiny_ops._layers import (
    Conv,
    Einsum,
    Linear,
    QuantizedConv,
    QuantizedEinsum,
    QuantizedKernel,
    QuantizedLinear,
    quantize_weight,
)
from taktiny_ops._quantize import LayerQuantization, QuantizationReport, quantize
from taktiny_ops._version import __version__

__all__ = [
    "FORMAT_VERSION",
    "LOADER",
    "ArtifactError",
    "Conv",
    "Einsum",
    "LayerQuantization",
    "Linear",
    "QuantizationReport",
    "QuantizedConv",
    "QuantizedEinsum",
    "QuantizedKernel",
    "QuantizedLinear",
    "TaktinyOpsError",
    "__version__",
    "conv_general_dilated",
    "dot_general",
    "einsum",
    "export_model",
    "linear",
    "load_model",
    "quantize",
    "quantize_weight",
]
