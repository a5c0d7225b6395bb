"""Pick a kernel by name and prove it on this machine before it serves.

A worker or backbone calls ``make_kernel(name, threads)`` once at start-up: the kernel is built,
then ``self_test`` runs (~0.5 s for ggml, every quant type); a kernel that fails raises
``KernelError`` naming it, so the process refuses to serve instead of returning bits that depend
on the batch. ``ggml`` is the default because it is the fast one; ``reference`` is the portable one.
"""

from __future__ import annotations

import threading

from ..errors import KernelError
from ..moe import Progress
from .base import Kernel
from .ggml_kernel import GgmlKernel
from .reference import ReferenceKernel
from .selftest import self_test

KERNELS: dict[str, type[GgmlKernel] | type[ReferenceKernel]] = {"ggml": GgmlKernel, "reference": ReferenceKernel}  # called with the thread count
DEFAULT = "ggml"


def make_kernel(name: str = DEFAULT, threads: int = 1, *, check: bool = True, progress: Progress | None = None) -> Kernel:
    """The kernel called *name* with *threads* threads, self-tested on this machine unless ``check=False``
    (*progress* hears the self-test's steps, and may raise to stop it).

    One self-tested instance per (name, threads) and process: kernels are thread safe, and the self-test proves
    a property of the build and the CPU, which do not change while we run."""
    make = KERNELS.get(name)
    if make is None:
        raise KernelError(f"unknown kernel {name!r}; choose one of {', '.join(sorted(KERNELS))}")
    if not check:
        return make(threads)
    with _CHECKING:
        kernel = _CHECKED.get((name, threads))
        if kernel is None:
            kernel = make(threads)
            self_test(kernel, progress=progress)
            _CHECKED[name, threads] = kernel
        return kernel


_CHECKED: dict[tuple[str, int], Kernel] = {}
_CHECKING = threading.Lock()  # one self-test at a time: a second caller waits for the first one's kernel
