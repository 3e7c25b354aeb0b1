"""Long documents cut into pieces of bounded size, so that tokenizing or counting them needs bounded memory.

The `tokenizers` library holds roughly 150 bytes per character of a text while it encodes it (offsets, pre-token
strings, the encoding's arrays), so one 50 MB document costs gigabytes. ``z2all prepare`` and
``z2all train-tokenizer`` therefore hand a document longer than :data:`MAX_PIECE_CHARS` characters to the tokenizer
in consecutive pieces; shorter documents go whole, exactly as before.

**Where a cut goes.** At a single space whose preceding character is a letter or a digit (``"word| next"``): the
pre-tokenizer (``zero2all.tokenizer.train.PRETOKENIZE_REGEX``) never lets a pre-token run from a letter or digit
into a following space, and the space starts the next pre-token in the whole text and in the second piece alike,
so encoding the pieces gives the very tokens of encoding the whole (and tokenizer training counts the same words).
A cut is looked for in the second half of each piece's window; when the window has no such space (a minified line,
a base64 blob), the cut goes before the last whitespace character after a non-space, and failing that at the
window's end: only then can the tokens at the cut differ from those of the whole document.
"""

from __future__ import annotations

import re
from typing import Iterator

MAX_PIECE_CHARS = 1 << 16

_EXACT_CUT = re.compile(r"(?<=[^\W_]) ")  # a space after a letter or digit (\w less "_": isalnum())
_WHITESPACE_CUT = re.compile(r"(?<=\S)\s")


def _last_match(pattern: re.Pattern, text: str, lo: int, hi: int) -> int | None:
    last = None
    for m in pattern.finditer(text, lo, hi):
        last = m.start()
    return last


def text_pieces(text: str, max_chars: int = MAX_PIECE_CHARS) -> Iterator[str]:
    """``text`` as consecutive pieces of at most ``max_chars`` characters that join back to it (see the module
    docstring for where the cuts go); a text of at most ``max_chars`` characters is one piece."""
    if max_chars < 2:
        raise ValueError(f"max_chars: must be >= 2, got {max_chars}")
    start = 0
    while len(text) - start > max_chars:
        lo, hi = start + max_chars // 2, start + max_chars
        cut = _last_match(_EXACT_CUT, text, lo, hi)
        if cut is None:
            cut = _last_match(_WHITESPACE_CUT, text, lo, hi)
        if cut is None or cut <= start:
            cut = hi
        yield text[start:cut]
        start = cut
    yield text[start:]
