"""The splitmix64 finaliser (Steele, Lea and Flood 2014), shared by MinHash, the quality filters and decontamination.

A leaf module: cleaning and decontamination both import it, and neither imports the other through it.
"""

from __future__ import annotations

import numpy as np

MIX1, MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(h: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on uint64 (wrapping)."""
    h = h ^ (h >> np.uint64(30))
    h = h * MIX1
    h = h ^ (h >> np.uint64(27))
    h = h * MIX2
    return h ^ (h >> np.uint64(31))
