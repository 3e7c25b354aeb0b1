"""Temperature weights for the cleaning report; the formula lives in :mod:`zero2all.corpus.mixture` (shared with
``z2all prepare --temperature``)."""

from zero2all.corpus.mixture import temperature_weights

__all__ = ["temperature_weights"]
