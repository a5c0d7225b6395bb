"""Compute kernels that work on a GGUF file's packed bytes in place; see ``base`` for the interface.

``ReferenceKernel`` is the portable numpy definition; ``GgmlKernel`` the fast one (ggml's CPU
code via ggml-python). ``self_test`` must pass on the running machine before a kernel serves.
"""

from .base import QTYPES, ExpertBias, Kernel, QuantWeight
from .choose import KERNELS, make_kernel
from .ggml_kernel import GgmlKernel
from .identity import KernelIdentity
from .reference import ReferenceKernel
from .selftest import self_test

__all__ = ["KERNELS", "QTYPES", "ExpertBias", "GgmlKernel", "Kernel", "KernelIdentity", "QuantWeight", "ReferenceKernel", "make_kernel", "self_test"]
