"""The former place of ``zero2all.accounting.moe``: importing this module gives that module itself."""

import sys

from zero2all.accounting import moe

sys.modules[__name__] = moe
