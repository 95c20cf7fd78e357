"""Where the workload, statistics and report helpers used to live: they are ``eval.harness``'s now.

Kept as an alias of :mod:`eval.harness` for the modules written against it that are not moved yet
(eval/grammar_libs.py); new code imports ``from eval import harness as H``.
"""

from eval.harness import *  # noqa: F403
from eval.harness import __all__  # noqa: F401
