"""Corpus cleaning: normalisation, exact and MinHash near-duplicate removal, quality rules, PII masking.

``clean(inputs, out, cfg)`` (:mod:`.pipeline`) runs it all and is what ``z2all clean`` calls; the parts are usable
on their own: :func:`normalize_text`, :func:`filter_document`, :func:`mask_pii`, :class:`MinHasher`,
:func:`find_clusters`, :class:`CleanConfig`.
"""

from zero2all.corpus.clean.config import CleanConfig, load_clean_config
from zero2all.corpus.clean.filters import RULES, filter_document
from zero2all.corpus.clean.minhash import MinHasher, choose_bands, find_clusters, s_curve
from zero2all.corpus.clean.normalize import detect_language, normalize_text
from zero2all.corpus.clean.pii import mask_pii
from zero2all.corpus.clean.pipeline import clean, lsh_parameters
from zero2all.corpus.mixture import temperature_weights

__all__ = ["RULES", "CleanConfig", "MinHasher", "choose_bands", "clean", "detect_language", "filter_document",
           "find_clusters", "load_clean_config", "lsh_parameters", "mask_pii", "normalize_text", "s_curve",
           "temperature_weights"]
