"""PII masking: e-mail addresses, IPv4 / IPv6 addresses and phone numbers become ``<EMAIL>``, ``<IP>``,
``<PHONE>``.

What is and is not masked (the look-alikes are tested in tests/test_clean.py):

* e-mail: ``local@domain.tld`` with a 2+ letter top-level domain (``user@localhost`` and ``a@b`` are kept).
* IPv4: four dot-separated decimal octets, each 0-255 without leading zeros, not part of a longer dotted number
  (``1.2.3.4.5``) and not a version: text such as ``v1.2.3.4``, ``version 1.2.3.4`` or ``release 10.0.0.1`` is
  kept. A bare ``1.2.3.4`` in prose is masked: it is indistinguishable from an address.
* IPv6: eight groups of 1-4 hex digits, or a ``::`` compressed form with at least two groups, validated with
  :mod:`ipaddress` (so times like ``12:30`` and ``a::b``-free text are kept).
* phones: international numbers written with a leading ``+`` and 8 to 15 digits (E.164), spaces, dots, dashes or
  one pair of parentheses between groups; Chinese mobile numbers ``1[3-9]`` + 9 digits (optionally ``+86``), not
  inside a longer run of digits. Dates (``2024-01-15``), prices (``$1,234.56``), ISBNs (``978-3-16-148410-0``,
  ``9783161484100``) and plain long numbers are kept.
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["PII_KINDS", "mask_pii"]

PII_KINDS = ("email", "ip", "phone")

_EMAIL_LOCAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}\Z")
_EMAIL_DOMAIN = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}(?![\w-])")
_OCTETS = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")
_VERSION_BEFORE = re.compile(r"(?:\bv|\bversion\s*|\bver\.?\s*|\brelease\s*|\bpython\s*|\bbuild\s*)$", re.I)
_IPV6 = re.compile(r"(?:[0-9A-Fa-f]{1,4}:|::)[0-9A-Fa-f:]{2,37}")
_PHONE_INTL = re.compile(r"\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){2,6}(?![\w-])")
_PHONE_CN = re.compile(r"1[3-9]\d(?:[ -]?\d{4}){2}(?!\d)")


def _emails(text: str) -> tuple[str, int]:
    """Anchored at each "@" (a regex scanning every position for a local part backtracks too much)."""
    out, last, n = [], 0, 0
    for at in re.finditer("@", text):
        i = at.start()
        if i < last:
            continue
        local = _EMAIL_LOCAL.search(text, max(last, i - 64), i)
        if local is None:
            continue
        start = local.start()
        while start < i and text[start] in "._%+-":  # a local part starts with a letter or digit
            start += 1
        if start > 0 and (text[start - 1].isalnum() or text[start - 1] in "._%+-"):
            continue
        dom = _EMAIL_DOMAIN.match(text, i + 1)
        if dom is None:
            continue
        out += [text[last:start], "<EMAIL>"]
        last, n = dom.end(), n + 1
    return ("".join(out) + text[last:], n) if n else (text, 0)


def _ipv4(m: re.Match) -> str:
    s, i, j = m.string, m.start(), m.end()
    if (i and (s[i - 1].isalnum() or s[i - 1] in "._")) or (j < len(s) and (s[j].isalnum() or s[j] == "_")) \
            or (s[j:j + 1] == "." and s[j + 1:j + 2].isdigit()):
        return m.group(0)  # part of a longer dotted number or a word
    if any(len(o) > 1 and o[0] == "0" or int(o) > 255 for o in m.group(0).split(".")):
        return m.group(0)
    if _VERSION_BEFORE.search(s, max(0, i - 12), i):
        return m.group(0)
    return "<IP>"


def _ipv6(m: re.Match) -> str:
    s, i, j = m.group(0), m.start(), m.end()
    if (i and (m.string[i - 1].isalnum() or m.string[i - 1] in "_.:")) or \
            (j < len(m.string) and (m.string[j].isalnum() or m.string[j] == "_")):
        return s
    groups = [g for g in s.split(":") if g]
    # C++ scopes (a::b) and clock times are not addresses: a digit, and three groups or a long first group
    if not any(c.isdigit() for c in s) or (len(groups) < 3 and len(groups[0] if groups else "") < 3):
        return s
    try:
        ipaddress.IPv6Address(s)
    except ValueError:
        return s
    return "<IP>"


def _phone_intl(m: re.Match) -> str:
    if m.start() and (m.string[m.start() - 1].isalnum() or m.string[m.start() - 1] == "+"):
        return m.group(0)
    digits = sum(c.isdigit() for c in m.group(0))
    return "<PHONE>" if 8 <= digits <= 15 else m.group(0)


def _phone_cn(m: re.Match) -> str:
    i = m.start()
    return m.group(0) if i and (m.string[i - 1].isdigit() or m.string[i - 1] == "+") else "<PHONE>"


def mask_pii(text: str, email: bool = True, ip: bool = True, phone: bool = True) -> tuple[str, dict]:
    """(the text with PII replaced by placeholders, {kind: count})."""
    counts = {}
    if email and "@" in text:
        text, n = _emails(text)
        if n:
            counts["email"] = n
    if ip:
        n0 = text.count("<IP>")
        if "." in text:
            text = _OCTETS.sub(_ipv4, text)
        if "::" in text or text.count(":") >= 7:
            text = _IPV6.sub(_ipv6, text)
        n = text.count("<IP>") - n0
        if n:
            counts["ip"] = n
    if phone:
        n0 = text.count("<PHONE>")
        if "+" in text:
            text = _PHONE_INTL.sub(_phone_intl, text)
        text = _PHONE_CN.sub(_phone_cn, text)
        n = text.count("<PHONE>") - n0
        if n:
            counts["phone"] = n
    return text, counts
