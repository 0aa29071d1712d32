"""The stages: one Prefect task module per stage (or stage pair), peers that never import each other.

Each follows the stage protocol, tasks/flowkit/stage.py (skip -> build -> manifest -> publish -> event);
what two stages share lives there or in tasks/core, never in a stage module (tests/test_structure.py).

- benchmark.py     benchmark: lm-eval scores of the base and the export on local tasks
- evaluate.py      evaluate_cpt, evaluate_sft and evaluate_dpo: held-out metrics and a generation check
- export.py        export: the last phase's final checkpoint (SFT's, or DPO's) -> a clean HF model folder
- gate.py          gate: the limits of `gate:` over the recorded metrics
- load.py          load_from_hf: the base model as a verified HF artifact
- prepare_data.py  prepare_cpt / prepare_sft / prepare_dpo: a corpus -> memory-mapped token shards
- push.py          push_to_hub: one commit of the verified export and its card
- reference.py     reference: the SFT model's log-probabilities of the DPO train pairs
- train.py         boost_and_shard / reboost / reboost_dpo (verb shard) and train_cpt / train_sft / train_dpo (verb train)
- unshard.py       unshard / unshard_sft: the final CPT (SFT) checkpoint -> cpt/hf/ (sft/hf/), the bridge
"""
