"""specd's evaluation tools, one package: ``python -m eval COMMAND [TOOL] ARGS`` from the repository root
(``eval/__main__.py`` lists the commands: bench, accept, load, costs, ...; eval/README.md explains them).

``eval.harness`` is the one harness every tool is a thin command line over: engines and daemons,
timing, percentiles, prompt loading and report writing live there and nowhere else.

Importing the package sets the defaults every tool wants before torch or transformers load:
offline Hugging Face hub, no tokenizers fork warnings, one OpenMP thread unless ``OMP_NUM_THREADS``
is set (tools with ``--threads`` set their own count).
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
