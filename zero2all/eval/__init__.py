"""Measuring models: token loss, perplexity and bits per byte over text files (``perplexity.py``, ``z2all eval``)
and an lm-evaluation-harness adapter (``harness.py``, imported only when lm-eval is used)."""

from zero2all.eval.perplexity import EvalResult, evaluate_files, evaluate_texts, score_documents

__all__ = ["EvalResult", "evaluate_texts", "evaluate_files", "score_documents"]
