"""MinHash near-duplicate detection with LSH banding, vectorised with numpy.

Shingles. A document is lower-cased and cut into code points (``text.encode("utf-32-le")`` viewed as uint32).
Word mode (English, code): words are runs of characters other than ASCII spaces and punctuation; a word's 64-bit
hash comes from prefix sums of a polynomial hash over its code points (one ``cumsum`` for the whole document, then
``(H[end] - H[start]) * B^-start`` per word, all mod 2^64), and a shingle combines ``n`` consecutive word hashes.
Character mode (Chinese): a shingle is ``n`` consecutive non-space characters. Each 64-bit shingle hash is mixed
and its top 32 bits kept: ``x < 2^32``.

Permutations. ``h_i(x) = ((a_i * x + b_i) mod 2^64) >> 32`` with random 64-bit ``a_i`` (odd) and ``b_i`` drawn
from ``seed``: the multiply-add-shift family of Dietzfelbinger (1996, "Universal hashing and k-wise independent
random variables via integer arithmetic without primes", STACS), strongly universal for 32-bit keys, and unlike
``(a x + b) mod p`` it needs no division (4x faster in numpy). The signature is the minimum of each ``h_i`` over
the document's shingles: one ``(shingles x num_perm)`` numpy operation per block of 512 shingles. Values are
32-bit, stored as uint32: ``num_perm * 4`` bytes per document.

Banding. ``b`` bands of ``r`` rows: two documents become candidates when all ``r`` values of some band agree,
with probability ``1 - (1 - s^r)^b`` at Jaccard similarity ``s`` (the S-curve). :func:`choose_bands` picks,
among the ``(b, r)`` with ``b * r <= num_perm`` whose curve reaches ``min_recall`` (0.95) at the threshold, the
one with the least area under the curve below the threshold (false candidates, each costing a check); a missed
duplicate is lost for good, a false candidate is only checked. A candidate pair is then verified: its
signature agreement (an unbiased estimate of the Jaccard similarity, standard deviation
``sqrt(t (1 - t) / num_perm)``) must be at least ``t - 2 sd``, which accepts ~97.7 % of pairs at exactly ``t``
and almost no pair at 0.5.

Clusters. Verified pairs are merged by a vectorised union-find whose roots are always the smallest document
index, so each cluster keeps its first document in input order and all others are removed.

Memory (:func:`find_clusters`): the signatures stay in a memory-mapped file; one band at a time is hashed to one
uint64 key per document, sorted, and its candidate pairs verified and merged: about 40 bytes per document in RAM
(key, sort order, parent array and the band's candidate pairs) besides the mapped signatures.
"""

from __future__ import annotations

import math

import numpy as np

from zero2all.corpus.hashing import MIX1 as _MIX1
from zero2all.corpus.hashing import mix64

__all__ = ["MinHasher", "band_candidates", "band_keys", "choose_bands", "find_clusters", "merge_band", "s_curve",
           "verify_bar", "verify_pairs"]

_U64 = np.uint64
_B = 0x9E3779B97F4A7C15          # odd polynomial base (mod 2^64)
_B_INV = pow(_B, -1, 1 << 64)
_NGRAM_MUL = [_U64((0xD6E8FEB86659FD93 * (2 * k + 1)) & 0xFFFFFFFFFFFFFFFF) for k in range(64)]

# ASCII characters that separate words (everything but letters and digits); non-ASCII spaces too
_SEP = np.zeros(0x10000, dtype=bool)  # indexed by min(code point, 0xFFFF); U+FFFF is a noncharacter
for _c in range(128):
    _SEP[_c] = not chr(_c).isalnum()
for _c in (0xA0, 0x3000, 0x2028, 0x2029, 0x3001, 0x3002, 0xFF0C, 0xFF1A, 0xFF1B):
    _SEP[_c] = True
_SPACE = np.zeros(0x10000, dtype=bool)
for _c in (9, 10, 11, 12, 13, 32, 0xA0, 0x3000):
    _SPACE[_c] = True


def s_curve(s, bands: int, rows: int):
    """Probability that a pair at Jaccard ``s`` shares at least one band: ``1 - (1 - s^r)^b``."""
    return 1.0 - (1.0 - np.asarray(s, dtype=np.float64) ** rows) ** bands


def choose_bands(threshold: float, num_perm: int, min_recall: float = 0.95) -> tuple[int, int]:
    """(bands, rows): the least false-candidate area below ``threshold`` among the choices whose S-curve is at
    least ``min_recall`` at ``threshold`` (if none is, the choice with the highest value there)."""
    lo = np.linspace(0.0, threshold, 201)
    best, best_key = (1, num_perm), (True, math.inf)
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            at_t = float(s_curve(threshold, b, r))
            key = (at_t < min_recall, -at_t) if at_t < min_recall else (False, float(np.trapezoid(s_curve(lo, b, r),
                                                                                                  lo)))
            if key < best_key:
                best, best_key = (b, r), key
    return best


def verify_bar(threshold: float, num_perm: int) -> float:
    return threshold - 2.0 * math.sqrt(threshold * (1.0 - threshold) / num_perm)


class _Powers:
    """B^i and B^-i mod 2^64 for i < n, grown on demand."""

    def __init__(self):
        self.pow = np.ones(1, dtype=_U64)
        self.inv = np.ones(1, dtype=_U64)

    def get(self, n: int):
        if len(self.pow) < n:
            m = max(n, 2 * len(self.pow), 4096)
            with np.errstate(over="ignore"):
                self.pow = np.concatenate([[_U64(1)], np.cumprod(np.full(m - 1, _B, dtype=_U64))])
                self.inv = np.concatenate([[_U64(1)], np.cumprod(np.full(m - 1, _B_INV, dtype=_U64))])
        return self.pow[:n], self.inv[:n]


_POWERS = _Powers()
_SEGMENT = 1 << 20


def _word_hashes(cp: np.ndarray, word: np.ndarray) -> np.ndarray:
    """One mixed 64-bit hash per run of word characters: prefix sums of ``c_i * B^i``, then
    ``(H[end] - H[start]) * B^-start`` (all mod 2^64), plus the length."""
    edges = np.diff(np.concatenate([[False], word, [False]]).astype(np.int8))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    pw, inv = _POWERS.get(len(cp) + 1)
    with np.errstate(over="ignore"):
        prefix = np.concatenate([[_U64(0)], np.cumsum(cp.astype(_U64) * pw[:len(cp)], dtype=_U64)])
        return mix64((prefix[ends] - prefix[starts]) * inv[starts] + (ends - starts).astype(_U64))


class MinHasher:
    """Signatures of documents: ``signature(text, mode)`` -> uint32[num_perm] (None without any shingle)."""

    def __init__(self, num_perm: int = 128, word_ngram: int = 5, char_ngram: int = 5, seed: int = 1,
                 lowercase: bool = True, block: int = 512):
        rng = np.random.default_rng(seed)
        self.num_perm, self.word_ngram, self.char_ngram = num_perm, word_ngram, char_ngram
        self.lowercase, self.block = lowercase, block
        self.a = rng.integers(0, 1 << 63, size=num_perm, dtype=np.int64).astype(_U64) * _U64(2) + _U64(1)
        self.b = rng.integers(0, 1 << 63, size=num_perm, dtype=np.int64).astype(_U64) * _U64(2)

    def shingles(self, text: str, mode: str = "word") -> np.ndarray:
        """The document's shingle hashes, uint64 values < 2^32 (one per shingle position, repeats included)."""
        if self.lowercase:
            text = text.lower()
        cp = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        small = np.minimum(cp, 0xFFFF)
        with np.errstate(over="ignore"):
            if mode == "char":
                units = mix64(cp[~_SPACE[small]].astype(_U64) + _U64(0x632BE59BD9B4E019))
                n = self.char_ngram
            else:
                word = ~_SEP[small]
                if not word.any():
                    return np.zeros(0, dtype=_U64)
                # segments of at most _SEGMENT code points cut at a separator, so that the power tables (and
                # the temporaries) stay bounded however long the document
                cuts, at = [0], 0
                while len(cp) - at > _SEGMENT:
                    seps = np.flatnonzero(~word[at + _SEGMENT // 2:at + _SEGMENT])
                    at = at + _SEGMENT // 2 + int(seps[-1]) if len(seps) else at + _SEGMENT
                    cuts.append(at)
                cuts.append(len(cp))
                units = np.concatenate([_word_hashes(cp[a:b], word[a:b]) for a, b in zip(cuts[:-1], cuts[1:])])
                n = self.word_ngram
            m = len(units)
            if m == 0:
                return units
            if m < n:
                n = m
            k = m - n + 1
            sh = units[:k] * _NGRAM_MUL[0]
            for j in range(1, n):
                sh = sh + units[j:j + k] * _NGRAM_MUL[j % 64]
            return mix64(sh) >> _U64(32)

    def signature(self, text: str, mode: str = "word") -> np.ndarray | None:
        x = self.shingles(text, mode)
        if len(x) == 0:
            return None
        sig = np.full(self.num_perm, 1 << 32, dtype=_U64)
        shift = _U64(32)
        with np.errstate(over="ignore"):
            for i in range(0, len(x), self.block):
                v = np.multiply(x[i:i + self.block, None], self.a[None, :])
                v += self.b
                v >>= shift
                np.minimum(sig, v.min(axis=0), out=sig)
        return sig.astype(np.uint32)


def band_keys(sigs: np.ndarray, band: int, rows: int) -> np.ndarray:
    """One uint64 key per row of ``sigs`` for band ``band`` (columns ``band*rows`` .. ``+rows``)."""
    cols = sigs[:, band * rows:(band + 1) * rows].astype(_U64)
    with np.errstate(over="ignore"):
        key = np.full(len(cols), _U64(band + 1) * _MIX1, dtype=_U64)
        for j in range(rows):
            key = mix64(key ^ cols[:, j])
    return key


def _roots(parent: np.ndarray, x: np.ndarray) -> np.ndarray:
    r = parent[x]
    while True:
        rr = parent[r]
        if np.array_equal(rr, r):
            return r
        r = rr


def _union(parent: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Merge the sets of each pair (a[i], b[i]); roots stay the smallest index of their set."""
    while len(a):
        ra, rb = _roots(parent, a), _roots(parent, b)
        diff = ra != rb
        if not diff.any():
            return
        a, b, ra, rb = a[diff], b[diff], ra[diff], rb[diff]
        np.minimum.at(parent, np.maximum(ra, rb), np.minimum(ra, rb))


def band_candidates(sigs: np.ndarray, idx: np.ndarray, band: int, rows: int, block: int = 1 << 20
                    ) -> tuple[np.ndarray, np.ndarray]:
    """LSH candidates of one band among the rows ``idx`` of ``sigs``: pairs (first document of a bucket, another
    document of it), both as row indices, ``a < b``."""
    keys = np.concatenate([band_keys(np.asarray(sigs[idx[i:i + block]]), band, rows)
                           for i in range(0, len(idx), block)])
    order = np.argsort(keys, kind="stable")  # ties keep input order: the run's first is its smallest index
    sk = keys[order]
    del keys
    same = np.flatnonzero(sk[1:] == sk[:-1]) + 1
    if not len(same):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    run_start = np.maximum.accumulate(np.where(np.concatenate([[True], sk[1:] != sk[:-1]]), np.arange(len(sk)), 0))
    return idx[order[run_start[same]]], idx[order[same]]


def verify_pairs(sigs: np.ndarray, a: np.ndarray, b: np.ndarray, bar: float | None) -> np.ndarray:
    """Which pairs' signature agreement is at least ``bar`` (all of them when ``bar`` is None)."""
    ok = np.ones(len(a), dtype=bool)
    if bar is not None:
        for i in range(0, len(a), 65536):
            sa, sb = np.asarray(sigs[a[i:i + 65536]]), np.asarray(sigs[b[i:i + 65536]])
            ok[i:i + 65536] = (sa == sb).mean(axis=1) >= bar
    return ok


def merge_band(parent: np.ndarray, a: np.ndarray, b: np.ndarray, ok, stats: dict, sigs=None, bar=None) -> None:
    """Union one band's candidate pairs into ``parent``: pairs already in one cluster are skipped (not counted),
    the others are verified (``ok`` given, or computed here from ``sigs`` and ``bar``) and merged."""
    if not len(a):
        return
    ra, rb = _roots(parent, a), _roots(parent, b)
    new = ra != rb
    a, b = a[new], b[new]
    stats["candidate_pairs"] += len(a)
    keep = ok[new] if ok is not None else verify_pairs(sigs, a, b, bar)
    a, b = a[keep], b[keep]
    stats["verified_pairs"] += len(a)
    _union(parent, a, b)


def _compress(parent: np.ndarray) -> np.ndarray:
    """Full path compression: every document points at its cluster's first document."""
    while True:
        pp = parent[parent]
        if np.array_equal(pp, parent):
            return parent
        parent = pp


def find_clusters(sigs: np.ndarray, alive: np.ndarray, bands: int, rows: int, bar: float | None,
                  block: int = 1 << 20, band_results=None) -> tuple[np.ndarray, dict]:
    """Union-find parents (``parent[i] == i`` for a kept document) over the rows of ``sigs`` where ``alive``.

    ``sigs``: (N, num_perm) uint32, memory-mapped or not. ``bar``: least signature agreement of a verified pair
    (None: every LSH candidate counts). ``band_results``: an iterator of ``(a, b, ok)`` per band in band order,
    computed elsewhere (Ray tasks running :func:`band_candidates` and :func:`verify_pairs`); merged here exactly as
    the bands computed in this process, so the clusters and the counts are the same. Returns (parent, stats)."""
    n = len(sigs)
    parent = np.arange(n, dtype=np.int64)
    idx = np.flatnonzero(alive)
    stats = {"candidate_pairs": 0, "verified_pairs": 0}
    if len(idx) < 2:
        return parent, stats
    if band_results is not None:
        for a, b, ok in band_results:
            merge_band(parent, a, b, ok, stats)
        return _compress(parent), stats
    for band in range(bands):
        a, b = band_candidates(sigs, idx, band, rows, block)
        merge_band(parent, a, b, None, stats, sigs, bar)
    return _compress(parent), stats
