"""Pre-flight: every check a run can fail in seconds, before a model is loaded or a rank started, and
the report.

- base_model.py    the base model itself: weights' format, its code, positions, chat template, family
- benchmark.py     the benchmark stage: lm-eval installed, tasks local, their YAML loads
- checks.py        the checks in order, the config's and the machine's, and the report they make
- data.py          each dataset exists and its first records have the fields the stage needs
- eval_memory.py   where each evaluation stage puts its models on this worker's GPUs
- eval_time.py     each evaluation stage's cost beside its training stage's
- kernels.py       what each stage's fast kernels and activation checkpointing will be
- long_context.py  which layout fits a long context
- memory.py        the memory one rank of a stage needs, each figure the sum of its parts
- memory_check.py  the refusals: a rank over its GPU, a node's ranks and the flow process over this host
- mixture.py       a stage's sources: repeats, weights, files that are not data
- model_files.py   the base model's own files: JSON parses, headers bounded, files are what they say
- model_info.py    what is known before anything loads: the machine and the model's metadata
- model_shapes.py  the shape of the base model's folder, and weights against config.json
- notices.py       a `file` preemption notice's path: nothing there yet, never opened
- report.py        the pre-flight report and what each check sees
- resume.py        what each training stage will do with the checkpoints already there
- storage.py       the run root reachable and writable, artifacts trustworthy, space, paths apart
- tokens.py        the tokenizer's special tokens, and SFT chats longer than seq_len
- tracking.py      an MLflow server answers at tracking.mlflow.uri
"""
