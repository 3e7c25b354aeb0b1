"""Constrained decoding: ``response_format`` JSON modes and forced tool calls, on a grammar compiled by xgrammar.

A request's format is compiled once (:meth:`Grammars.compile`) into a grammar over the model's vocabulary; each
sequence that uses it gets a :class:`Constraint` (a matcher with its own state). Before a constrained row's next
token is drawn, the tokens that cannot continue a valid output are set to ``-inf`` in its logits
(:func:`apply_masks`: greedy and sampled rows alike, after the repetition penalty, before top-k / top-p); the drawn
token then advances the matcher. Once the grammar is complete the only tokens left are the stop tokens, so the row
draws one and ends with ``finish_reason`` "stop" (a row whose ``ignore_eos`` dropped its stop tokens ends there too).
A row that runs out of ``max_tokens`` first ends with "length" and a cut-off output, as OpenAI's does.

Why xgrammar (the ``structured`` extra) and not outlines-core: ``json_object`` is a recursive grammar (any JSON
object, nested to any depth). xgrammar compiles context-free grammars and has one for JSON; it compiled that grammar
and a schema's in milliseconds over our vocabularies on CPU, and its mask is filled by C++ per row. outlines-core
works from regular expressions, so nesting is bounded, and building its index for ``{"type": "object"}`` took 9.6 s
even over a 256-token vocabulary. outlines-core has no dependencies of its own, but every dependency of xgrammar
(torch, transformers, triton, numpy, pydantic) is already ours but one small package (apache-tvm-ffi).

The vocabulary is handed to xgrammar as raw bytes per token (:func:`vocab_bytes`), so any tokenizer with a
``token_bytes()`` method works (ours: byte-level BPE and SentencePiece BPE with byte fallback); special tokens and
the model's padded rows are empty, which xgrammar never allows except as stop tokens.

JSON is generated compactly (``{"a": 1, "b": [2, 3]}``: one space after ``:`` and ``,``, none elsewhere), so a model
cannot spend its budget on whitespace; properties come in the schema's order, and properties the schema does not
name are not generated (xgrammar's strict mode: the output is valid under the schema either way).
"""

from __future__ import annotations

import json
import threading
from typing import Sequence

import torch

PACKAGE = "xgrammar"
INSTALL_HINT = "pip install 'zero2all[structured]'"


class GrammarUnavailable(Exception):
    """xgrammar is not installed."""


class GrammarError(ValueError):
    """A format or schema the grammar compiler cannot turn into a grammar (unsupported or malformed)."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise GrammarUnavailable(f"structured output needs the '{PACKAGE}' package, which is not installed on "
                                 f"this server ({INSTALL_HINT})") from e
    return xgrammar


def available() -> bool:
    try:
        _xgrammar()
    except GrammarUnavailable:
        return False
    return True


def vocab_bytes(tokenizer, size: int) -> list[bytes]:
    """Each token id's bytes as it appears in decoded text, for ``size`` ids (the model's padded vocabulary): the
    tokenizer's own ``token_bytes()`` when it has one, else each id decoded alone (an id that decodes to a partial
    character is left out: it would need its neighbours). Specials and padding are ``b""``."""
    if hasattr(tokenizer, "token_bytes"):
        known = list(tokenizer.token_bytes())
    else:
        specials = set(getattr(tokenizer, "special_ids", {}).values())
        known = []
        for i in range(min(size, len(tokenizer))):
            text = "" if i in specials else tokenizer.decode([i])
            known.append(b"" if "\ufffd" in text else text.encode("utf-8"))
    known = known[:size]
    return known + [b""] * (size - len(known))


class Grammars:
    """The grammar compiler of one model's vocabulary (made on first use; compiled grammars are cached by xgrammar
    itself). ``stop_ids``: the tokens that end a sequence whose grammar is complete."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(int(i) for i in stop_ids)
        self._compiler = None
        self._lock = threading.RLock()   # requests compile on worker threads: one compile at a time

    def compiler(self):
        xgr = _xgrammar()
        with self._lock:
            if self._compiler is None:
                # a token holding a control character is never allowed: JSON forbids them raw inside strings (the
                # grammar's string rule lets them through, and a strict parser such as Python's json or a browser's
                # JSON.parse then refuses the output), and compact JSON needs none outside strings
                vocab = [b"" if any(c < 0x20 for c in t) else t for t in vocab_bytes(self.tokenizer, self.vocab_size)]
                info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW,
                                         vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def json_schema(self, schema: dict | bool) -> "Grammar":
        """A grammar for one JSON value valid under ``schema``; raises :class:`GrammarError`."""
        compiler = self.compiler()
        try:
            text = json.dumps(schema)
            with self._lock:
                return Grammar(compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True))
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(_reason(e)) from None

    def json_object(self) -> "Grammar":
        """Any JSON object (OpenAI's JSON mode)."""
        return self.json_schema({"type": "object"})

    def tool_call(self, tools: Sequence[tuple[str, dict | None]]) -> "Grammar":
        """One call of one of ``tools`` ((name, parameters schema or None: any object) pairs), written as the chat
        template's block (``data/tools.py``): ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>`` with
        ARGS valid under that tool's schema. A schema that cannot be compiled raises :class:`GrammarError` whose
        ``index`` is the tool's place in ``tools``."""
        from zero2all.data.tools import CLOSE, OPEN

        xgr = _xgrammar()
        calls = []
        for i, (name, schema) in enumerate(tools):
            try:
                args = xgr.Grammar.from_json_schema(json.dumps(schema if schema else {"type": "object"}),
                                                    any_whitespace=False, strict_mode=True)
            except (RuntimeError, ValueError, TypeError) as e:
                err = GrammarError(_reason(e))
                err.index = i
                raise err from None
            head = OPEN + json.dumps({"name": name, "arguments": 0})[:-2]   # '<tool_call>{"name": "f", "arguments": '
            calls.append(xgr.Grammar.concat(_literal(xgr, head), args, _literal(xgr, "}" + CLOSE)))
        grammar = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
        try:
            compiler = self.compiler()
            with self._lock:
                return Grammar(compiler.compile_grammar(grammar))
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(_reason(e)) from None


def _literal(xgr, text: str):
    """A grammar of exactly ``text`` (a JSON string literal is an EBNF string literal)."""
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))


def _reason(e: BaseException) -> str:
    """The compiler's complaint in one line."""
    text = " ".join(str(e).split())
    return text[:300] if text else type(e).__name__


class Grammar:
    """A compiled grammar: :meth:`start` gives a fresh :class:`Constraint` per sequence."""

    def __init__(self, compiled):
        self.compiled = compiled

    def start(self) -> "Constraint":
        return Constraint(_xgrammar().GrammarMatcher(self.compiled))


class Constraint:
    """One sequence's matcher: which tokens may come next (:meth:`fill`), and the token drawn (:meth:`accept`)."""

    def __init__(self, matcher):
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, index: int):
        """Write this row's allowed tokens into row ``index`` of an int32 bitmask (bit j of word w: token 32w+j)."""
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def accept(self, token: int) -> bool:
        """Advance by the drawn token; False if the grammar refuses it (a token the mask allowed never is)."""
        return bool(self.matcher.accept_token(int(token)))

    @property
    def done(self) -> bool:
        """A stop token was accepted: the output is complete."""
        return bool(self.matcher.is_terminated())


def bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask for ``rows`` rows (CPU: xgrammar fills it there)."""
    return torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)


def unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 bitmask -> (R, vocab_size) bool, True where a token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).bool().view(bits.size(0), -1)[:, :vocab_size]


def apply_masks(logits: torch.Tensor, rows: Sequence[int], constraints: Sequence[Constraint]) -> torch.Tensor:
    """Set the disallowed tokens of each constrained row to -inf, in place; logits (B, V). Returns logits."""
    V = logits.size(-1)
    bits = bitmask(len(rows), V)
    for i, c in enumerate(constraints):
        c.fill(bits, i)
    allowed = unpack(bits.to(logits.device), V)
    idx = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits
