"""The project's tasks. Importing any of it first keeps transformers from importing scikit-learn, which
nothing here uses (tasks/core/models/hf_imports.py).

- core/     pure logic of the lifecycle: no Prefect, no ColossalAI, no torch.distributed
- engine/   the torchrun ranks: the engine verbs shard and train, without Prefect
- flowkit/  what every stage is built with on the Prefect side: the stage protocol, UI, tracking
- stages/   the Prefect stage tasks, one module per stage (or stage pair), peers
"""

from tasks.core.models.hf_imports import install as _install

_install()
