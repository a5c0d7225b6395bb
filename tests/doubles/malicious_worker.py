"""A worker that returns perturbed partial sums (a test double run as a real process).

Usage: python -m tests.doubles.malicious_worker worker [moeswarm worker options]
It is the real worker with one change: every answer is nudged by 1% noise, plausible
enough to pass NaN/Inf checks, wrong enough for a spot check to catch.
"""

import numpy as np

from node.cli.root import main
from node.worker import service as worker

_honest = worker.Worker._compute


async def _perturbed(self, layer, x, ids, w, held):
    sums = await _honest(self, layer, x, ids, w, held)
    noise = np.random.default_rng(layer).standard_normal(sums.shape).astype(np.float32)
    return sums + 0.01 * float(np.abs(sums).mean()) * noise


worker.Worker._compute = _perturbed

if __name__ == "__main__":
    main()
