"""Data: read a corpus, tokenize it once into memory-mapped token shards, and read those back.

    python -m tasks.core.data.prepare --tokenizer runs/demo/base-model --uri data/sample/cpt.jsonl --kind cpt --out /tmp/prep

- records.py : record formats (FORMATS, format_of) and the one reader: streamed records of a file with their line numbers
- samples.py : CPT packing, SFT chat rendering and loss masks, the SFT record rules
- chat_template.py: every chat template render, as transformers renders it, under a budget of steps, output and time
- inputs.py  : `data.uri` (file, list, glob, directory; any fsspec URI) -> sorted files with size and checksum
- split.py   : a record's id and the held-out split it decides
- shard.py   : one input file -> self-contained token shards (training and held-out sides); the shared frame
- encoders.py: one encoder per record kind (text, chat), named by the phase's row (tasks.core.config.phases)
- spec.py    : the PrepareSpec, built once from a phase's config section
- index.py   : index.json's name, the tokenizer fingerprint, and the check that the data fits a model
- prepare.py : plan (which shards exist), run the missing ones on a process pool, write the index
- chunks.py  : a file larger than data.tokenize.chunk_mb cut at record boundaries, each chunk tokenized, merged back byte for byte
- schedule.py: the one loop that runs files and chunks on a runner (a process pool here, Prefect's in prepare_data)
- blend.py   : a weighted mixture's blended stream; order.py: the epoch orders (length groups, packs)
- heldout_only.py: held-out-only sources (cpt.eval.heldout_sources), evaluated and never trained on
- reader.py  : the memmap reader the training loop indexes by block (CPT) or row (SFT)
- prepared.py: what a training or evaluation stage reads from its prepared data

Pure logic (numpy, fsspec, tokenizers): no prefect, no colossalai, no torch.distributed.
"""
