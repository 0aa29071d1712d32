"""Data: read a corpus, tokenize it once into memory-mapped token shards, and read those back.

    python -m tasks.core.data.prepare --tokenizer runs/demo/base-model --uri data/sample/cpt.jsonl --kind cpt --out /tmp/prep

Pure logic (numpy, fsspec, tokenizers): no prefect, no colossalai, no torch.distributed.

- blend.py          a weighted mixture's blended stream: which source feeds every position
- chat_template.py  chat templates rendered as transformers does, under a budget of steps, output and time
- chunks.py         a large file cut at record boundaries, chunks tokenized alone, merged back byte for byte
- dataset.py        the training side of prepared data: blocks (CPT) or rows (SFT) from the shards
- encoders.py       one encoder per record kind (text, chat; pairs: pairs.py), named by the phase's row
- heldout_only.py   held-out-only sources, evaluated and never trained on
- index.py          index.json, the tokenizer fingerprint, and the check that the data fits a model
- inputs.py         `data.uri` (file, list, glob, directory; any fsspec URI) -> files with size and checksum
- order.py          the epoch orders a batching row asks for: length groups, packs
- pairs.py          preference pairs: the layouts users have, read into one form, checked, encoded for DPO
- prepare.py        plan the shards, tokenize the missing ones, write the index
- records.py        record formats and the one reader: streamed records with their line numbers
- samples.py        CPT packing, SFT chat rendering and loss masks, the SFT record rules
- schedule.py       the one loop that runs files and chunks on a runner
- shard.py          one input file -> self-contained token shards (training and held-out sides)
- spec.py           the PrepareSpec, built once from a phase's config section
- split.py          a record's id and the held-out split it decides
- stage_data.py     what a training or evaluation stage reads from data/<phase>/
- truncation.py     records longer than seq_len, counted per file, per source and in all
"""
