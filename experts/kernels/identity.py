"""What a kernel is, as a worker announces it: results are bit-comparable only between equal identities.

Two machines whose kernels have the same identity compute the same bits for the same
inputs (that is what the startup self-test and the identity together promise); a
backbone spot-checking a worker with another identity must use the quantized-weights
tolerance instead of exact equality.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelIdentity:
    """Library, its version, how it was built and which CPU features its code paths use.

    ``fallback`` names the quant types this kernel hands to the numpy reference (their
    bits are then the reference's, on any machine).
    """

    library: str
    version: str
    build: tuple[str, ...] = ()
    cpu: tuple[str, ...] = ()
    fallback: tuple[str, ...] = ()

    def __str__(self) -> str:
        parts = [f"{self.library}-{self.version}"]
        if self.build:
            parts.append("build=" + ",".join(self.build))
        if self.cpu:
            parts.append("cpu=" + ",".join(self.cpu))
        if self.fallback:
            parts.append("fallback=" + ",".join(self.fallback))
        return ";".join(parts)
