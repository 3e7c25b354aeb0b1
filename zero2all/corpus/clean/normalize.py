"""Text normalisation and a coarse language label (``en`` / ``zh`` / ``code``) that picks the rules and shingles.

``normalize_text``: Unicode NFC (or NFKC, which also folds full-width forms and ligatures), control and
zero-width characters removed (``\\n`` and ``\\t`` kept), ``\\r\\n`` / ``\\r`` -> ``\\n``, runs of spaces inside a
line collapsed (not in code, where indentation matters), trailing spaces dropped, long runs of blank lines cut.
Chinese text is left without spaces: nothing here inserts or removes spaces between CJK characters.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["CODE_EXTENSIONS", "cjk_count", "detect_language", "normalize_text"]

# C0 and C1 controls except \t and \n, DEL, zero-width space / joiners, BOM, soft hyphen
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200d\u2060\ufeff\u00ad]")
_SPACES = re.compile(r"[ \t\u00a0\u3000\u2000-\u200a\u202f\u205f]{2,}|[\t\u00a0\u2000-\u200a\u202f\u205f]")
_TRAILING = re.compile(r"[ \t\u3000]+$", re.M)
# CJK unified ideographs (+ extension A, compatibility ideographs)
_CJK = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
CODE_EXTENSIONS = (".py", ".js", ".ts", ".java", ".c", ".h", ".cc", ".cpp", ".hpp", ".go", ".rs", ".rb", ".php",
                   ".cs", ".sh", ".scala", ".kt", ".swift", ".lua", ".pl", ".r", ".jl", ".m", ".sql")


def normalize_text(text: str, form: str = "NFC", strip_control: bool = True, collapse_spaces: bool = True,
                   max_blank_lines: int = 2, code: bool = False) -> str:
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if form != "none" and not text.isascii():
        text = unicodedata.normalize(form, text)
    if strip_control:
        text = _CONTROL.sub("", text)
    # each substitution only where a cheap substring test says it can change something (they scan every character)
    ascii_ = text.isascii()
    if collapse_spaces and not code and ("  " in text or "\t" in text or not ascii_):
        text = _SPACES.sub(" ", text)
    if " \n" in text or "\t\n" in text or text.endswith((" ", "\t")) or (not ascii_ and "\u3000" in text):
        text = _TRAILING.sub("", text)
    if max_blank_lines >= 0 and "\n" * (max_blank_lines + 2) in text:
        text = re.sub(r"\n{%d,}" % (max_blank_lines + 2), "\n" * (max_blank_lines + 1), text)
    return text.strip("\n") if not code else text.strip("\n") + "\n"


def cjk_count(text: str) -> int:
    return len(_CJK.findall(text))


def detect_language(rec: dict, text: str) -> str:
    """``code`` for records that say so (category ``code``, a code file name or extension), ``zh`` when CJK
    characters are at least 20 % of the non-space characters of the first 2,000, else ``en`` (any
    space-separated language)."""
    others = rec.get("others") or {}
    lang = others.get("lang") or others.get("language") if isinstance(others, dict) else None
    if isinstance(lang, str) and lang:
        low = lang.lower()
        if low.startswith("zh"):
            return "zh"
        if low in ("code", "python", "javascript", "java", "c", "c++", "go", "rust"):
            return "code"
        return "en"
    if rec.get("category") == "code":
        return "code"
    name = (rec.get("title") or rec.get("id") or "").lower()
    if name.endswith(CODE_EXTENSIONS):
        return "code"
    head = text[:2000]
    letters = len(head) - head.count(" ") - head.count("\n")
    if letters and cjk_count(head) >= 0.2 * letters:
        return "zh"
    return "en"
