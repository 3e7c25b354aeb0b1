"""Moved to :mod:`zero2all.corpus.readers`; this module only re-exports it.

It stays until ``zero2all/cli.py`` imports from ``zero2all.corpus``; delete it then.
"""

from zero2all.corpus.readers import *  # noqa: F401,F403
from zero2all.corpus.readers import __all__  # noqa: F401
