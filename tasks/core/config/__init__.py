"""Configuration: the run config schema (a leaf), its loader, the rules a config must obey, and the
registries of plugins, phases, kernels, launch backends, notices and layout rules.

- backends.py        the launch-backend registry: where a stage's torchrun agents run
- base.py            the base of every config section model: frozen, unknown keys refused
- batching.py        the batching registry: how SFT conversations become micro-batch rows
- benchmark.py       the `benchmark:` section and the gate's limits on its scores
- bounded_yaml.py    YAML from untrusted files, parsed under bounds on size, nesting and aliases
- context.py         context extension for CPT: RoPE settings, attention kept inside documents
- data.py            a stage's data sections: corpus or mixture, tokenizing, held-out-only sources
- elastic.py         a training stage's preemption settings and the keep-the-global-batch rule
- fixes.py           a refusal's fixes as data: dotted overrides that make the rule pass
- kernels.py         the kernel registry: which fast kernels apply under which plugin and device
- layout.py          `ParallelLayout`: a stage's parallel layout, every rule stated once
- load.py            loading a run config: bounded YAML, dotted overrides, the schema, the rules
- lora.py            a LoRA adapter's settings (`<phase>.lora`)
- model_rules.py     the layout rules of the base's shape: tp divides heads and vocabulary, pp the layers
- notices.py         the preemption-notice registry: one row per way a machine gives notice
- outputs.py         what a run produces: `export:`, `gate:` and `hub:`
- overrides.py       the typed per-run overrides of a deployment run
- paths.py           where relative paths in configs point: the project root
- phases.py          the training-phase registry: CPT, SFT and DPO as rows of one table
- plugins.py         the plugin registry: one row per ColossalAI booster plugin
- preference.py      the preference phase's settings: the loss registry, a pair's fields
- reference.py       the configuration reference page, written from the schema and registries
- schema.py          the lifecycle configuration: frozen pydantic models, one description per field
- sequence.py        sequence parallelism as data: one row per mode
- sequence_rules.py  the layout rules of sequence parallelism
- slurm.py           the Slurm backend's settings and their static rule
- tracking.py        the `tracking:` section: where per-step metrics are mirrored
"""
