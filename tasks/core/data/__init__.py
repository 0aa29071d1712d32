"""Data preparation: tokenize a corpus once into memory-mapped token shards (issue 14).

    python -m tasks.core.data.prepare --tokenizer runs/demo/base-model --uri data/sample/cpt.jsonl --kind cpt --out /tmp/prep

- inputs.py  : `data.uri` (file, list, glob, directory; any fsspec URI) -> sorted files with size and checksum
- records.py : streamed records of one file with its line numbers; bad records named by file:line
- shard.py   : one input file -> self-contained token shards (training and held-out sides)
- prepare.py : plan (which shards exist), run the missing ones on a process pool, write the index
- reader.py  : the memmap reader the training loop indexes by block (CPT) or row (SFT)

Pure logic (numpy, fsspec, tokenizers): no prefect, no colossalai, no torch.distributed.
"""
