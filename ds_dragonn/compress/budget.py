"""How many pairs a buffer sends: the target ``k`` and the cap on a selection (a leaf module: ``base`` and
``chunks`` both read it)."""
from __future__ import annotations

import math

#: A selection never holds more than ``ceil(MAX_PAIRS_FACTOR × k)`` pairs, whatever the value
#: distribution: ties at the sampled threshold (all ±1, quantised values) would otherwise fill DRAGONN's
#: whole table (``table_factor × k`` pairs, 4x the byte budget).
MAX_PAIRS_FACTOR = 1.1


def target_k(numel: int, density: float) -> int:
    """``k = ceil(density * numel)``, at most numel; 0 for an empty buffer (no division by zero)."""
    if numel <= 0:
        return 0
    # round() guards against 0.01 * 100 = 1.0000000000000002 -> 2; at least one element is kept
    return max(1, min(numel, math.ceil(round(density * numel, 9))))


def max_pairs(k: int) -> int:
    """Most pairs a selection with target ``k`` may send: ``ceil(MAX_PAIRS_FACTOR × k)`` (0 for k = 0)."""
    return math.ceil(round(MAX_PAIRS_FACTOR * k, 9)) if k > 0 else 0
