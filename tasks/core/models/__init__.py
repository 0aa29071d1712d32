"""Models: the family registry, checkpoint -> HF conversion and its proof, HF artifacts, logits
fingerprints, stop tokens, FLOPs per token, and the demo's tiny model.

- adapter.py       `export-adapter/`: a LoRA run's adapter alone, proven to be the merged export
- claims.py        config.json's sizes against what the weight files' headers hold, before anything is built
- convert/         streaming conversion of a sharded checkpoint to HF safetensors, and its proof
- demo.py          tiny deterministic demo inputs: a BPE tokenizer and a random model
- derive.py        a family derived from the model transformers builds on the meta device
- families.py      the model-family registry: everything known per decoder family, as data
- family_spec.py   the shapes of the family registry's rows
- family_table.py  the families x plugins table, written from the registries
- fingerprint.py   logits on a fixed probe batch, stored with the artifact's provenance
- flops.py         model FLOPs per token and accelerators' peak FLOP/s: what MFU is measured against
- folder.py        which files may sit in an HF model folder; a folder's code kept out
- hf_artifact.py   build an HF-format artifact from a checkpoint, without torchrun or a GPU
- hf_imports.py    transformers without scikit-learn
- lora_targets.py  which modules a LoRA `target_modules` adapts, decided as peft decides
- merge.py         the merged export of a LoRA checkpoint, proven two ways
- policy_rows.py   named rows for the families ColossalAI 0.5.0 ships a shardformer policy for
- preference.py    the preference losses (DPO, IPO) and their metrics, from per-sequence log-probabilities
- shapes.py        the shapes of Hub model folders, each run or refused before launch
- sizes.py         config.json's size fields: each a whole number >= 1
- stop_tokens.py   stop tokens of an export: eos plus the chat template's end-of-turn tokens
- stream.py        probe logits of an HF folder in bounded memory, one unit's weights at a time
- tp_plan.py       plan rows: the families sharded at tp by the derived policy, read from their own plan
"""
