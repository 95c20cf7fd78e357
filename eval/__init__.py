"""specd's evaluation scripts, one package: run them from the repository root as modules,

    python -m eval.acceptance ...     python -m eval.bench_latency ...     python -m eval.soak ...

``eval.harness`` is the one place that starts a daemon (in process or as a child process), times an
engine (from its public ``timings`` and drafter counters), logs its steps, computes percentiles and
describes the machine; ``eval.common`` holds the workload (prompts, speculation modes) and the
acceptance statistics, tables and plots. Each other module is an entry point over those two.

Importing the package sets the defaults every script wants before torch or transformers load:
offline Hugging Face hub, no tokenizers fork warnings, one OpenMP thread unless ``OMP_NUM_THREADS``
is set (scripts with ``--threads`` set their own count).
"""

import os


def _environment_defaults() -> None:
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("OMP_NUM_THREADS", "1"),
    ):
        os.environ.setdefault(key, value)


_environment_defaults()
