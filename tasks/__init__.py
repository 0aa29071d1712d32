"""The project's tasks: `stages/` the Prefect stage tasks, `flowkit/` what they are built with, `core/` their pure
logic, `engine/` the torchrun ranks.

Importing any of it first keeps transformers from importing scikit-learn, which nothing here uses
(tasks/core/models/hf_imports.py).
"""

from tasks.core.models.hf_imports import install as _install

_install()
