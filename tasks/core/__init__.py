"""Pure logic of the lifecycle, by concern: no Prefect, no ColossalAI, no torch.distributed.

- config/      the run config: schema, bounded loader, rules, and the registries (plugins, phases, ...)
- data/        corpora to memory-mapped token shards and back
- errors.py    errors shown to users, each naming the field or file and the fix
- evaluation/  held-out metrics, the generation check, lm-eval scores, the gate's verdict
- hub/         the Hugging Face Hub: repo-id rules, the token, the model card
- launch/      launch backends (torchrun here or on Slurm) and teardown of every process of a stage
- models/      the family registry, checkpoint -> HF conversion and its proof, fingerprints, FLOPs
- preflight/   every check a run can fail in seconds, before a model is loaded or a rank started
- run/         the run and its artifacts: stage list, manifests, digests, the job file, events
- storage/     the one fsspec seam, S3 transfers, the checkpoint publisher, the run-root lease
"""
