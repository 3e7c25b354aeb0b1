"""Corpus readers: files of many formats in, one record schema out (see :mod:`zero2all.corpus.readers`).

This package sits below both ``zero2all.tokenizer`` (which trains on corpus text) and ``zero2all.data`` (which
turns corpus records into token shards), so imports only point downwards: data -> tokenizer -> corpus.
"""

from zero2all.corpus.readers import (
                                     BAD_KINDS,
                                     COMPRESSIONS,
                                     DEFAULT_TEXT_FIELDS,
                                     FORMATS,
                                     RECORD_FIELDS,
                                     BadInputError,
                                     ReadStats,
                                     SourceSpec,
                                     default_source_name,
                                     expand_paths,
                                     input_bytes,
                                     iter_records,
                                     iter_texts,
                                     open_binary,
                                     stdlib_files,
                                     write_jsonl,
)

__all__ = ["BAD_KINDS", "COMPRESSIONS", "DEFAULT_TEXT_FIELDS", "FORMATS", "RECORD_FIELDS", "BadInputError",
           "ReadStats", "SourceSpec", "default_source_name", "expand_paths", "input_bytes", "iter_records",
           "iter_texts", "open_binary", "stdlib_files", "write_jsonl"]
