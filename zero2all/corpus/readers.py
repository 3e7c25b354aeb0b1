"""Corpus readers: files of many formats in, one record schema out.

``iter_records(source)`` streams records from

* ``.json``    a top-level array of objects, streamed item by item with ijson (the file is never loaded whole);
* ``.jsonl``   one object per line;
* ``.parquet`` row batches via pyarrow, reading only the columns the schema needs;
* ``.txt``     one document per file (``txt_mode="file"``) or per blank-line separated block (``"paragraph"``);

each optionally compressed as ``.gz`` or ``.zst``. A source is a file, a directory (recursed, files sorted), a
glob (``data/**/*.jsonl.zst``) or the name ``stdlib``: the running Python's standard library ``.py`` files
(without tests or site-packages), the embedded offline corpus (~12 MB of code). The name ``site-packages`` is the
second embedded corpus, the installed packages' sources split by package (:mod:`zero2all.corpus.site_packages`,
default settings; ``z2all corpus`` builds one with a byte cap, another seed or listed validation packages):
``site-packages`` gives both splits, each record's ``others["split"]`` saying which (``z2all prepare`` keeps it),
``site-packages:train`` / ``site-packages:valid`` one of them.

Every record has the same schema (the original project's)::

    {"gid": int,        # position in this iteration, 0, 1, 2, ...
     "id": str,         # the record's own "id" field if it has one, else "FILE:LINE" / "FILE:#ROW"
     "data_src": str,   # source name (see SourceSpec), e.g. "stdlib", "zh", or the file stem
     "category": str, "title": str, "content": str, "desc": str,
     "others": dict}    # every other field of the input record

The text comes from ``text_field`` (default: the first of ``content``, ``text`` that the record has).

Bad input never stops a run half-way: a malformed JSON line, invalid UTF-8, an empty file, a missing text field,
a non-string text or an unreadable file (a truncated ``.gz``) is skipped and counted per kind in
:class:`ReadStats`, which keeps the first examples with ``file:line`` and prints a report at the end.
``strict=True`` raises :class:`BadInputError` naming ``file:line`` at the first one instead.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from zero2all.fileio import atomic_write

__all__ = ["BAD_KINDS", "COMPRESSIONS", "DEFAULT_TEXT_FIELDS", "FORMATS", "RECORD_FIELDS", "BadInputError",
           "ReadStats", "SourceSpec", "check_out_outside_inputs", "default_source_name", "expand_paths",
           "input_bytes", "iter_records", "iter_texts", "open_binary", "stdlib_files",
           "SITE_PACKAGES_SOURCES", "tool_metadata_files", "write_jsonl"]

RECORD_FIELDS = ("gid", "id", "data_src", "category", "title", "content", "desc", "others")
DEFAULT_TEXT_FIELDS = ("content", "text")
FORMATS = (".jsonl", ".json", ".parquet", ".txt")
COMPRESSIONS = (".gz", ".zst")
BAD_KINDS = ("malformed_json", "invalid_utf8", "empty_file", "missing_field", "non_string", "unreadable")

# The embedded corpus: directories of the standard library that hold tests, vendored or generated packages.
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                     "lib2to3", "ensurepip", "turtledemo", "unittest_test"}


class BadInputError(ValueError):
    """A malformed input in strict mode; the message starts with ``file:line``."""


@dataclass
class ReadStats:
    """Counts of records read and of bad inputs skipped, per kind, with the first ``max_examples`` locations."""

    max_examples: int = 5
    records: int = 0
    files: int = 0
    bytes: int = 0  # UTF-8 bytes of the text fields yielded
    bad: dict = field(default_factory=dict)
    examples: list = field(default_factory=list)

    def add_bad(self, kind: str, where: str, detail: str) -> None:
        self.bad[kind] = self.bad.get(kind, 0) + 1
        if len(self.examples) < self.max_examples:
            self.examples.append(f"{where}: {kind}: {detail}")

    @property
    def skipped(self) -> int:
        return sum(self.bad.values())

    def report(self) -> str:
        head = (f"read {self.records:,} records ({self.bytes / 1e6:,.1f} MB of text) from {self.files:,} "
                f"file{'s' if self.files != 1 else ''}")
        if not self.bad:
            return head + "; no bad input"
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(self.bad.items()))
        lines = [head + f"; skipped {self.skipped:,} bad inputs ({kinds}); first examples:"]
        lines += [f"  {e}" for e in self.examples]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"records": self.records, "files": self.files, "bytes": self.bytes, "bad": dict(self.bad),
                "examples": list(self.examples)}

    def merge_dict(self, other: dict) -> None:
        """Add the counts of another reader's :meth:`to_dict` (a file read elsewhere, e.g. by a Ray task)."""
        self.records += other["records"]
        self.files += other["files"]
        self.bytes += other["bytes"]
        for kind, n in other["bad"].items():
            self.bad[kind] = self.bad.get(kind, 0) + n
        self.examples += other["examples"][:max(self.max_examples - len(self.examples), 0)]


@dataclass
class SourceSpec:
    """One named source: ``NAME=PATH[,PATH...]`` or just ``PATH`` (the name is then the file/dir stem).

    ``text_field`` (None = ``content`` then ``text``) and ``weight`` (a mixture sampling rate, see
    ``zero2all.data.pretokenize``) are per source.
    """

    name: str
    paths: list
    text_field: str | None = None
    weight: float = 1.0

    @classmethod
    def parse(cls, text: str, text_field: str | None = None) -> "SourceSpec":
        name, sep, rest = text.partition("=")
        if sep and name and "/" not in name and not Path(text).exists():
            paths = [p for p in rest.split(",") if p]
        else:
            name, paths = default_source_name(text), [text]
        if not paths:
            raise ValueError(f"source {text!r}: no path given (expected NAME=PATH or PATH)")
        return cls(name=name, paths=paths, text_field=text_field)


SITE_PACKAGES_SOURCES = ("site-packages", "site-packages:train", "site-packages:valid")


def default_source_name(path: str) -> str:
    if path == "stdlib":
        return "stdlib"
    if path in SITE_PACKAGES_SOURCES:
        return path.replace(":", "-")
    if any(ch in path for ch in "*?["):  # a glob: name it after its directory ("data/zh/*.jsonl" -> "zh")
        fixed = [part for part in Path(path).parts]
        cut = next(i for i, part in enumerate(fixed) if any(ch in part for ch in "*?["))
        if cut > 0:
            return fixed[cut - 1].strip("/") or "data"
    p = Path(path.rstrip("/"))
    name = p.name
    for suffix in COMPRESSIONS + FORMATS:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name.replace("*", "") or "data"


# --------------------------------------------------------------------------------------------------------------
# file discovery


def _is_data_file(path: str) -> bool:
    name = path.lower()
    for c in COMPRESSIONS:
        if name.endswith(c):
            name = name[: -len(c)]
    return name.endswith(FORMATS)


def stdlib_files() -> list[Path]:
    """The running Python's standard library ``.py`` files, sorted, without tests and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("test"))
        for f in sorted(filenames):
            if f.endswith(".py") and not f.startswith("test_") and f != "__phello__.py":
                out.append(Path(dirpath) / f)
    return out


def expand_paths(path_or_glob: str) -> list[str]:
    """A file, a directory (recursed) or a glob -> sorted data files. Raises FileNotFoundError if none."""
    if path_or_glob == "stdlib":
        return [str(p) for p in stdlib_files()]
    if path_or_glob in SITE_PACKAGES_SOURCES:
        corpus = _site_packages_corpus()
        splits = [path_or_glob.split(":")[1]] if ":" in path_or_glob else ["train", "valid"]
        return [f[2] for s in splits for f in corpus.files[s]]
    if os.path.isdir(path_or_glob):
        files = []
        for dirpath, dirnames, filenames in os.walk(path_or_glob):
            # hidden folders hold work files (`clean`'s .work/, temporaries), never the user's data
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            own = tool_metadata_files(filenames)
            files += [os.path.join(dirpath, f) for f in filenames
                      if _is_data_file(f) and not f.startswith(".") and f not in own]
        if not files:
            raise FileNotFoundError(f"{path_or_glob}: directory holds no data files ({', '.join(FORMATS)}, "
                                    f"optionally {', '.join(COMPRESSIONS)})")
        return sorted(files)
    if any(ch in path_or_glob for ch in "*?["):
        files = sorted(f for f in glob.glob(path_or_glob, recursive=True) if os.path.isfile(f))
        if not files:
            raise FileNotFoundError(f"{path_or_glob}: the pattern matches no files")
        return files
    if os.path.isfile(path_or_glob):
        return [path_or_glob]
    raise FileNotFoundError(f"{path_or_glob}: no such file, directory or glob (or the source names 'stdlib', "
                            f"'site-packages')")


# The metadata files of this project's own output folders, recognised by the files that mark each kind of output:
# a directory input reads the data in such a folder (`clean`'s shards), never its report or bookkeeping.
_CLEAN_SHARD = re.compile(r"^clean-\d{5}\.jsonl$")
_PREPARE_MARKER = re.compile(r"^(shard_\d{5}\.json|(train|valid)_\d{5}\.bin)$")
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "z2all_tokenizer.json"}
_RUN_FILES = {"config.json", "z2all.json", "metrics.jsonl", "generation_config.json"}


def tool_metadata_files(filenames: Iterable[str]) -> set[str]:
    """The names among ``filenames`` (one folder's files) that are metadata of a zero2all output in that folder:
    ``report.json`` beside ``clean-NNNNN.jsonl`` shards, ``meta.json`` / ``_state.json`` / ``shard_NNNNN.json``
    of token shards, tokenizer files beside ``z2all_tokenizer.json``, a checkpoint's or run's ``config.json`` /
    ``z2all.json`` / ``metrics.jsonl``, a corpus's ``manifest.json`` beside its ``train.jsonl`` / ``valid.jsonl``.
    Files of the same names in other folders are data like any other."""
    names = set(filenames)
    own: set[str] = set()
    if any(_CLEAN_SHARD.match(n) for n in names) or {"report.json", "report.md"} <= names:
        own.add("report.json")
    if any(_PREPARE_MARKER.match(n) for n in names):
        own |= {n for n in names if n in ("meta.json", "_state.json") or _PREPARE_MARKER.match(n)}
    if "z2all_tokenizer.json" in names or "z2all.json" in names:
        own |= names & _TOKENIZER_FILES
    if "z2all.json" in names or "metrics.jsonl" in names:
        own |= names & (_RUN_FILES | {"report.json"})
    if {"train.jsonl", "valid.jsonl", "manifest.json"} <= names:  # a `z2all corpus` output
        own.add("manifest.json")
    return own


def check_out_outside_inputs(inputs: Iterable[str], out: str | os.PathLike, option: str = "--out") -> None:
    """Refuse (:class:`BadInputError`, one line) an output folder inside a directory input: the next run would read
    the output back as input. ``inputs``: the sources as given (``NAME=PATH[,PATH]``, globs, ``stdlib``) or
    SourceSpecs."""
    out_abs = os.path.realpath(out)
    for text in inputs:
        spec = text if isinstance(text, SourceSpec) else SourceSpec.parse(str(text))
        for path in spec.paths:
            if path == "stdlib" or path in SITE_PACKAGES_SOURCES or not os.path.isdir(path):
                continue
            root = os.path.realpath(path)
            if out_abs == root or out_abs.startswith(root.rstrip(os.sep) + os.sep):
                raise BadInputError(f"{option} {out}: inside the input directory {path}, so a later run would read "
                                    f"its own output; choose an {option} outside {path}")


def input_bytes(paths: Iterable[str]) -> int:
    """Total on-disk size of the files of the given sources (a progress-bar total; compressed files count as is)."""
    return sum(os.path.getsize(f) for p in paths for f in expand_paths(p))


# --------------------------------------------------------------------------------------------------------------
# opening and decoding


def open_binary(path: str):
    """Open a possibly ``.gz`` / ``.zst`` compressed file as a binary stream."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        raw = open(path, "rb")
        return zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
    return open(path, "rb")


def _format_of(path: str) -> str:
    name = path.lower()
    for c in COMPRESSIONS:
        if name.endswith(c):
            name = name[: -len(c)]
    for fmt in FORMATS:
        if name.endswith(fmt):
            return fmt
    if path.endswith(".py"):
        return ".txt"
    raise ValueError(f"{path}: unknown format (expected one of {', '.join(FORMATS)}, optionally "
                     f"{', '.join(COMPRESSIONS)})")


class _Reader:
    """Shared state of one ``iter_records`` call: where records go, how bad input is handled."""

    def __init__(self, stats: ReadStats, strict: bool, text_field: str | None, data_src: str, txt_mode: str):
        self.stats, self.strict, self.data_src, self.txt_mode = stats, strict, data_src, txt_mode
        self.text_fields = (text_field,) if text_field else DEFAULT_TEXT_FIELDS
        self.gid = 0

    def bad(self, kind: str, where: str, detail: str) -> None:
        if self.strict:
            raise BadInputError(f"{where}: {kind}: {detail}")
        self.stats.add_bad(kind, where, detail)

    def record(self, obj, where: str, default_id: str, default_title: str = "") -> dict | None:
        """Map one input object onto the record schema, or count why it cannot be."""
        if not isinstance(obj, dict):
            self.bad("malformed_json", where, f"expected a JSON object, got {type(obj).__name__}")
            return None
        key = next((k for k in self.text_fields if k in obj), None)
        if key is None:
            self.bad("missing_field", where, f"no text field {' or '.join(map(repr, self.text_fields))} "
                                             f"(fields: {', '.join(list(obj)[:8])})")
            return None
        text = obj[key]
        if not isinstance(text, str):
            self.bad("non_string", where, f"field {key!r} is {type(text).__name__}, not a string")
            return None
        # an input's own "data_src" stays in others (the record's data_src is the reader's source name)
        known = {"gid", "id", "category", "title", "desc", "others", key}
        others = dict(obj.get("others") or {}) if isinstance(obj.get("others"), dict) else {}
        others.update({k: v for k, v in obj.items() if k not in known})
        return self.make(text, where=where, id=str(obj.get("id", default_id)),
                         category=_str(obj.get("category")), title=_str(obj.get("title")) or default_title,
                         desc=_str(obj.get("desc")), others=others)

    def make(self, text: str, where: str, id: str, category: str = "", title: str = "", desc: str = "",
             others: dict | None = None) -> dict:
        rec = {"gid": self.gid, "id": id, "data_src": self.data_src, "category": category, "title": title,
               "content": text, "desc": desc, "others": others or {}}
        self.gid += 1
        self.stats.records += 1
        self.stats.bytes += len(text.encode("utf-8", "surrogatepass"))
        return rec


def _str(v) -> str:
    return "" if v is None else v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _decode(raw: bytes, where: str, reader: _Reader) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        reader.bad("invalid_utf8", where, f"byte {e.start}: {raw[e.start:e.start + 4]!r} is not UTF-8")
        return None


def _read_jsonl(path: str, r: _Reader) -> Iterator[dict]:
    with open_binary(path) as f:
        stream = io.BufferedReader(f) if not hasattr(f, "peek") else f
        n_lines = 0
        for lineno, raw in enumerate(stream, 1):
            n_lines += 1
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            line = _decode(raw, where, r)
            if line is None:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                r.bad("malformed_json", where, f"{e.msg} (column {e.colno})")
                continue
            rec = r.record(obj, where, default_id=f"{os.path.basename(path)}:{lineno}")
            if rec is not None:
                yield rec
        if n_lines == 0:
            r.bad("empty_file", f"{path}:0", "the file is empty")


def _read_json(path: str, r: _Reader) -> Iterator[dict]:
    """A top-level JSON array, streamed with ijson: memory stays at one item however large the file."""
    import ijson

    with open_binary(path) as f:
        head = f.read(4096)
        if not head.strip():
            r.bad("empty_file", f"{path}:0", "the file is empty")
            return
        stream = _Prepend(head, f)
        index = -1
        try:
            for index, obj in enumerate(ijson.items(stream, "item", use_float=True)):
                rec = r.record(obj, f"{path}:#{index}", default_id=f"{os.path.basename(path)}:#{index}")
                if rec is not None:
                    yield rec
        except ijson.JSONError as e:
            msg = e.args[0] if e.args else str(e)
            msg = (msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)).strip().splitlines()[0]
            kind = "invalid_utf8" if "utf" in msg.lower() or "decode" in msg.lower() else "malformed_json"
            # the rest of a broken array cannot be resynchronised; the items before it were yielded
            r.bad(kind, f"{path}:#{index + 1}", f"{msg[:200]} (rest of the file skipped)")
        except UnicodeDecodeError as e:
            r.bad("invalid_utf8", f"{path}:#{index + 1}", f"{e.reason} (rest of the file skipped)")
        if index == -1 and head.lstrip()[:1] not in (b"[",):
            r.bad("malformed_json", f"{path}:1", "expected a top-level JSON array ('[' ...); use .jsonl for "
                                                 "one object per line")


class _Prepend(io.RawIOBase):
    """A binary stream that first returns ``head`` then the rest of ``f`` (used after sniffing a file)."""

    def __init__(self, head: bytes, f):
        self.head, self.f = head, f

    def readable(self):
        return True

    def read(self, n=-1):
        if self.head:
            if n is None or n < 0:
                out, self.head = self.head + self.f.read(), b""
                return out
            out, self.head = self.head[:n], self.head[n:]
            return out
        return self.f.read(n)

    def readinto(self, b):
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def _read_parquet(path: str, r: _Reader, batch_rows: int = 1024) -> Iterator[dict]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a broken or empty file
        kind = "empty_file" if os.path.getsize(path) == 0 else "unreadable"
        r.bad(kind, f"{path}:#0", f"not a readable parquet file ({type(e).__name__}: {str(e)[:120]})")
        return
    names = pf.schema_arrow.names
    wanted = [c for c in names if c in set(RECORD_FIELDS) | set(r.text_fields)]
    if pf.metadata.num_rows == 0:
        r.bad("empty_file", f"{path}:#0", "the file has no rows")
        return
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=wanted):
        for obj in batch.to_pylist():
            rec = r.record(obj, f"{path}:#{row}", default_id=f"{os.path.basename(path)}:#{row}")
            row += 1
            if rec is not None:
                yield rec


def _read_txt(path: str, r: _Reader) -> Iterator[dict]:
    with open_binary(path) as f:
        raw = f.read()
    name = os.path.basename(path)
    if not raw.strip():
        r.bad("empty_file", f"{path}:0", "the file is empty" if not raw else "the file holds only whitespace")
        return
    if r.txt_mode == "file":
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            r.bad("invalid_utf8", f"{path}:{line}", f"byte {raw[e.start:e.start + 1]!r} is not UTF-8")
            return
        yield r.make(text, where=f"{path}:1", id=name, category="text", title=name)
        return
    # paragraph mode: blocks separated by one or more blank lines, each its own document
    lineno, block, start = 0, [], 1
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        if line.strip():
            if not block:
                start = lineno
            block.append(line)
            continue
        if block:
            yield from _txt_block(block, path, start, r)
            block = []
    if block:
        yield from _txt_block(block, path, start, r)


def _txt_block(lines: list, path: str, start: int, r: _Reader) -> Iterator[dict]:
    text = _decode(b"\n".join(lines), f"{path}:{start}", r)
    if text is not None:
        yield r.make(text.rstrip("\r"), where=f"{path}:{start}", id=f"{os.path.basename(path)}:{start}",
                     category="text")


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".txt": _read_txt}


# --------------------------------------------------------------------------------------------------------------
# the public entry points


def iter_records(source: str | SourceSpec | list, text_field: str | None = None, txt_mode: str = "file",
                 strict: bool = False, stats: ReadStats | None = None, data_src: str | None = None) -> Iterator[dict]:
    """Stream records (see the module docstring for the schema) from one or several sources.

    ``source``: a path, directory, glob, ``"stdlib"``, a ``NAME=PATH`` spec, a :class:`SourceSpec`, or a list of
    those (read in order). ``txt_mode``: ``"file"`` (a whole .txt file is one document) or ``"paragraph"``
    (blank-line separated blocks). Bad inputs are counted in ``stats`` (pass your own to read the report) or
    raise :class:`BadInputError` when ``strict``.
    """
    if txt_mode not in ("file", "paragraph"):
        raise ValueError(f"txt_mode: {txt_mode!r} is not one of file, paragraph")
    stats = stats if stats is not None else ReadStats()
    specs = source if isinstance(source, list) else [source]
    gid = 0
    for spec in specs:
        if not isinstance(spec, SourceSpec):
            spec = SourceSpec.parse(str(spec), text_field=text_field)
        r = _Reader(stats, strict, spec.text_field or text_field, data_src or spec.name, txt_mode)
        r.gid = gid
        for path in spec.paths:
            if path in SITE_PACKAGES_SOURCES:
                corpus = _site_packages_corpus()
                for rec in corpus.records(path.split(":")[1] if ":" in path else None):
                    stats.files += 1
                    yield r.make(rec["content"], where=f"{rec['id']}:1", id=rec["id"], category="code",
                                 title=rec["title"], others=rec["others"])
                continue
            is_stdlib = path == "stdlib"
            for f in expand_paths(path):
                stats.files += 1
                if is_stdlib:
                    yield from _read_stdlib_file(f, r)
                else:
                    try:
                        yield from _READERS[_format_of(f)](f, r)
                    except BadInputError:
                        raise
                    except (OSError, EOFError) as e:  # truncated .gz / .zst, unreadable file
                        r.bad("unreadable", f"{f}:0", f"{type(e).__name__}: {e}")
        gid = r.gid


def _site_packages_corpus():
    from zero2all.corpus.site_packages import build_site_packages_corpus

    return build_site_packages_corpus()


def _read_stdlib_file(path: str, r: _Reader) -> Iterator[dict]:
    raw = Path(path).read_bytes()
    rel = os.path.relpath(path, sysconfig.get_paths()["stdlib"])
    if not raw.strip():
        return  # empty __init__.py files are normal in the standard library, not bad input
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        r.bad("invalid_utf8", f"{path}:1", "not UTF-8")
        return
    yield r.make(text, where=f"{path}:1", id=rel, category="code", title=rel,
                 others={"python": f"{sys.version_info[0]}.{sys.version_info[1]}"})


def iter_texts(source, **kwargs) -> Iterator[str]:
    """Only the text of each record (what tokenizer training and pretokenization need)."""
    for rec in iter_records(source, **kwargs):
        yield rec["content"]


# --------------------------------------------------------------------------------------------------------------
# writing records


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> int:
    """Write records as JSON lines (non-ASCII kept as is), atomically. ``.gz``/``.zst`` compress. Returns count."""
    path = str(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with atomic_write(path, "wb") as raw:
        if path.endswith(".gz"):
            f = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0)
        elif path.endswith(".zst"):
            import zstandard

            f = zstandard.ZstdCompressor().stream_writer(raw, closefd=False)
        else:
            f = None
        out = f or raw
        for rec in records:
            out.write(json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n")
            n += 1
        if f is not None:
            f.close()
    return n
