"""Temperature sampling over sources: per-source weights (expected copies of each document) from source sizes.

Used by the cleaning report (weights suggested from the cleaned sizes) and by ``z2all prepare --temperature``.

With ``s_i`` the bytes of a source (after cleaning, for the report), the natural mixture is ``q_i = s_i / sum(s)``.
Temperature sampling draws source ``i`` with probability ``p_i = q_i^(1/T) / sum_j q_j^(1/T)`` (Arivazhagan et al. 2019,
"Massively Multilingual Neural Machine Translation in the Wild", Section 4.2, T = 5; Conneau & Lample 2019, XLM,
alpha = 1/T = 0.5): T = 1 keeps the natural mixture, larger T flattens it towards uniform, so small sources
(a low-resource language, code) are seen more often. ``prepare`` takes per-source weights as expected copies of each
document, so the weight that gives ``p`` at the same total size is ``w_i = p_i / q_i`` (< 1 samples, > 1 repeats).
"""

from __future__ import annotations

__all__ = ["temperature_weights"]


def temperature_weights(sizes: dict[str, float], temperature: float) -> dict[str, float]:
    """{source: weight} for ``prepare --source NAME=W``; sources of size 0 get weight 0."""
    if temperature <= 0:
        raise ValueError(f"temperature: must be positive, got {temperature}")
    total = sum(v for v in sizes.values() if v > 0)
    if total <= 0:
        return {k: 0.0 for k in sizes}
    q = {k: v / total for k, v in sizes.items() if v > 0}
    z = sum(x ** (1.0 / temperature) for x in q.values())
    return {k: (q[k] ** (1.0 / temperature) / z) / q[k] if k in q else 0.0 for k in sizes}
