"""``CleanConfig``: every switch and threshold of ``z2all clean``, loaded from a ``[clean]`` TOML table.

A file holds one ``[clean]`` table with sub-tables, every key optional (the defaults below are the published
thresholds, each citing its source in :mod:`zero2all.corpus.clean.filters`)::

    [clean]
    workers = 4
    [clean.dedup]
    threshold = 0.8
    num_perm = 128
    [clean.gopher]
    enabled = false

Overrides are ``key=value`` with or without the leading ``clean.`` (``dedup.threshold=0.7``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

from zero2all.config import ConfigError, deep_merge, from_dict, parse_override, to_dict

__all__ = ["C4Config", "CleanConfig", "CodeConfig", "DecontamConfig", "DedupConfig", "GopherConfig", "NormalizeConfig",
           "PiiConfig", "RepetitionConfig", "ZhConfig", "load_clean_config"]


@dataclass
class NormalizeConfig:
    form: str = "NFC"               # NFC | NFKC | none
    strip_control: bool = True      # drop C0/C1 control characters except \n and \t, and zero-width characters
    collapse_spaces: bool = True    # runs of spaces/tabs inside a line -> one space; trailing spaces dropped
    max_blank_lines: int = 2        # longer runs of blank lines are cut to this many (-1 = keep)


@dataclass
class DedupConfig:
    exact: bool = True
    near: bool = True
    threshold: float = 0.8          # target Jaccard similarity of shingle sets
    num_perm: int = 128             # MinHash permutations
    bands: int = 0                  # 0 = chosen from the threshold (see minhash.choose_bands)
    rows: int = 0
    word_ngram: int = 5             # word shingles (English, code)
    char_ngram: int = 5             # character shingles (Chinese)
    verify: bool = True             # accept an LSH candidate only if its signature agreement is high enough
    seed: int = 1
    lowercase: bool = True


@dataclass
class GopherConfig:
    """Rae et al. 2021, "Scaling Language Models: Methods, Analysis & Insights from Training Gopher", App. A.1.1."""

    enabled: bool = True
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1
    max_bullet_lines: float = 0.9
    max_ellipsis_lines: float = 0.3
    min_alpha_words: float = 0.8
    min_stop_words: int = 2


@dataclass
class RepetitionConfig:
    """Rae et al. 2021, Table A1 (repetition removal)."""

    enabled: bool = True
    max_dup_line_fraction: float = 0.30
    max_dup_para_fraction: float = 0.30
    max_dup_line_char_fraction: float = 0.20
    max_dup_para_char_fraction: float = 0.20
    max_top_ngram_fractions: list[float] = field(default_factory=lambda: [0.20, 0.18, 0.16])       # n = 2, 3, 4
    max_dup_ngram_fractions: list[float] = field(default_factory=lambda: [0.15, 0.14, 0.13, 0.12, 0.11, 0.10])  # 5..10


@dataclass
class C4Config:
    """Raffel et al. 2020, "Exploring the Limits of Transfer Learning ...", Section 2.2 (the C4 rules)."""

    enabled: bool = True
    min_words_per_line: int = 5     # lines with fewer words are dropped
    min_sentences: int = 3          # pages with fewer sentences are removed
    terminal_punctuation: bool = True  # keep only lines ending in . ! ? or a closing quote
    drop_javascript_lines: bool = True
    lorem_ipsum: bool = True
    curly_bracket: bool = True


@dataclass
class ZhConfig:
    """Chinese: no spaces, so character counts replace word counts (project thresholds, see filters.py)."""

    enabled: bool = True
    min_chars: int = 50             # CJK characters
    min_cjk_ratio: float = 0.3      # CJK characters / non-space characters
    max_dup_line_fraction: float = 0.30  # Gopher's line rule applies as is


@dataclass
class CodeConfig:
    """Chen et al. 2021 (Codex, Section 3.1) and Li et al. 2023 (StarCoder, Section 3)."""

    enabled: bool = True
    max_line_length: int = 1000
    max_mean_line_length: float = 100.0
    min_alnum_fraction: float = 0.25
    autogen_markers: bool = True
    autogen_head_lines: int = 5


@dataclass
class PiiConfig:
    enabled: bool = True
    email: bool = True
    ip: bool = True
    phone: bool = True


@dataclass
class DecontamConfig:
    """Benchmark decontamination (:mod:`zero2all.corpus.decontam`): documents sharing a word n-gram with a set."""

    sets: list[str] = field(default_factory=list)  # --decontaminate values: [NAME=]PATH or lm-eval:TASK
    ngram: int = 13                 # words per n-gram (Brown et al. 2020, GPT-3, App. C)
    report_only: bool = False       # count and show matching documents, keep them


_FORMS = ("NFC", "NFKC", "none")


@dataclass
class CleanConfig:
    workers: int = 0                # 0 = all cores
    chunk_docs: int = 2000          # records per work unit (and per resume marker)
    chunk_mb: float = 8.0           # ... or this much text, whichever comes first
    shard_chunks: int = 16          # work units per output shard
    examples: int = 3               # removed documents kept as examples per rule
    dry_run_docs: int = 5000
    temperatures: list[float] = field(default_factory=lambda: [2.0, 5.0])  # source weights printed in the report
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    gopher: GopherConfig = field(default_factory=GopherConfig)
    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)
    c4: C4Config = field(default_factory=C4Config)
    zh: ZhConfig = field(default_factory=ZhConfig)
    code: CodeConfig = field(default_factory=CodeConfig)
    pii: PiiConfig = field(default_factory=PiiConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)

    def validate(self, prefix: str = "clean") -> "CleanConfig":
        for section in (self,) + tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                                       if dataclasses.is_dataclass(getattr(self, f.name))):
            name = prefix if section is self else f"{prefix}.{_field_of(self, section)}"
            for f in dataclasses.fields(section):
                v = getattr(section, f.name)
                if isinstance(v, float) and not math.isfinite(v):
                    raise ConfigError(f"{name}.{f.name}: must be a finite number, got {v}")
        if self.workers < 0:
            raise ConfigError(f"{prefix}.workers: must be >= 0 (0 = all cores), got {self.workers}")
        for key in ("chunk_docs", "shard_chunks", "dry_run_docs"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{prefix}.{key}: must be >= 1, got {getattr(self, key)}")
        if self.chunk_mb <= 0:
            raise ConfigError(f"{prefix}.chunk_mb: must be positive, got {self.chunk_mb}")
        if not all(isinstance(t, float) and t > 0 for t in self.temperatures):
            raise ConfigError(f"{prefix}.temperatures: expected positive numbers, got {self.temperatures}")
        if self.examples < 0:
            raise ConfigError(f"{prefix}.examples: must be >= 0, got {self.examples}")
        if self.normalize.form not in _FORMS:
            raise ConfigError(f"{prefix}.normalize.form: {self.normalize.form!r} is not one of {', '.join(_FORMS)}")
        d = self.dedup
        if not 0.0 < d.threshold < 1.0:
            raise ConfigError(f"{prefix}.dedup.threshold: must be in (0, 1), got {d.threshold}")
        if d.num_perm < 2:
            raise ConfigError(f"{prefix}.dedup.num_perm: must be >= 2, got {d.num_perm}")
        if (d.bands == 0) != (d.rows == 0):
            raise ConfigError(f"{prefix}.dedup.bands/rows: give both or neither (0 = chosen from the threshold)")
        if d.bands < 0 or d.rows < 0 or d.bands * d.rows > d.num_perm:
            raise ConfigError(f"{prefix}.dedup.bands * rows = {d.bands * d.rows} must be in [1, num_perm = "
                              f"{d.num_perm}]")
        for key in ("word_ngram", "char_ngram"):
            if getattr(d, key) < 1:
                raise ConfigError(f"{prefix}.dedup.{key}: must be >= 1, got {getattr(d, key)}")
        g = self.gopher
        if g.min_words > g.max_words:
            raise ConfigError(f"{prefix}.gopher.min_words: {g.min_words} > max_words {g.max_words}")
        if g.min_mean_word_length > g.max_mean_word_length:
            raise ConfigError(f"{prefix}.gopher.min_mean_word_length: {g.min_mean_word_length} > "
                              f"max_mean_word_length {g.max_mean_word_length}")
        for sec, keys in (("gopher", ("max_symbol_word_ratio", "max_bullet_lines", "max_ellipsis_lines",
                                      "min_alpha_words")),
                          ("repetition", ("max_dup_line_fraction", "max_dup_para_fraction",
                                          "max_dup_line_char_fraction", "max_dup_para_char_fraction")),
                          ("zh", ("min_cjk_ratio", "max_dup_line_fraction")), ("code", ("min_alnum_fraction",))):
            for key in keys:
                v = getattr(getattr(self, sec), key)
                if not 0.0 <= v <= 1.0:
                    raise ConfigError(f"{prefix}.{sec}.{key}: must be in [0, 1], got {v}")
        if self.decontam.ngram < 1:
            raise ConfigError(f"{prefix}.decontam.ngram: must be >= 1, got {self.decontam.ngram}")
        if not all(isinstance(x, str) and x for x in self.decontam.sets):
            raise ConfigError(f"{prefix}.decontam.sets: expected a list of paths, got {self.decontam.sets}")
        r = self.repetition
        for key, n in (("max_top_ngram_fractions", 3), ("max_dup_ngram_fractions", 6)):
            v = getattr(r, key)
            if len(v) != n or not all(0.0 <= x <= 1.0 for x in v):
                raise ConfigError(f"{prefix}.repetition.{key}: expected {n} fractions in [0, 1], got {v}")
        return self

    def to_dict(self) -> dict:
        return to_dict(self)


def _field_of(cfg: CleanConfig, section) -> str:
    return next(f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) is section)


def load_clean_config(path: str | Path | None = None, overrides: Iterable[str] | None = None) -> CleanConfig:
    """A validated :class:`CleanConfig` from a TOML file's ``[clean]`` table (or the defaults) and overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
        if "clean" not in raw:
            raise ConfigError(f"{path}: no [clean] table (tables found: {', '.join(raw) or 'none'})")
        data = raw["clean"]
    for text in overrides or []:
        keys, value = parse_override(text)
        if keys[0] == "clean":
            keys = keys[1:]
        if not keys:
            raise ConfigError(f"override {text!r}: bad key")
        nested: dict = value
        for k in reversed(keys):
            nested = {k: nested}
        data = deep_merge(data, nested)
    return from_dict(CleanConfig, data, "clean").validate()
