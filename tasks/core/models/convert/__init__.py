"""Streaming conversion of a sharded model checkpoint to an HF-standard safetensors directory.

Input: a ColossalAI 0.5.0 checkpoint written by
`booster.save_model(model, dir, shard=True, use_safetensors=True)` (any plugin), or a plain HF
directory (`model.safetensors`, or shards plus `model.safetensors.index.json`); pickled `.bin`
checkpoints only with `allow_pickle=True`. Output: `model-0000K-of-0000N.safetensors` shards
planned by a byte budget and a byte-correct `model.safetensors.index.json` (or a single
`model.safetensors`), plus `config.json`, optionally cast to one dtype.

What ColossalAI 0.5.0 writes (read from colossalai/checkpoint_io/*.py, and what this module relies on):
- Keys are the unwrapped HF model's parameter names and tensors are full: HybridParallel
  gathers tp shards (`gather_distributed_param`) and strips the vocabulary padding it added for
  tp (`to_unpadded_tensor`) before saving. A half-size or padded tensor therefore means a save
  that bypassed that code, and is reported as such.
- pp == 1: `model-00001.safetensors`, `model-00002.safetensors`, ... (no "-of-"), always with an
  index, even for one shard. pp > 1: every stage writes `model-stage-0000S-shard-0000K.safetensors`
  (S and K from 1) and rank 0 merges the per-stage indexes (from `tmp_index_files/`) into one.
- The index's `metadata.total_size` is a float in MiB (`numel * element_size / 1024 / 1024`),
  not bytes as in transformers; this module never trusts it and recomputes from the headers.
- Tied embeddings: HybridParallel saves `named_parameters()`, which yields a tied weight once
  (no `lm_head.weight`) when pp == 1; with pp > 1 the first stage saves
  `model.embed_tokens.weight` and the last stage saves `lm_head.weight`, kept equal by the
  shared-parameter sync. DDP/LowLevelZero save `model.state_dict()`, which lists both names; on
  GPU `.cpu()` copies them so both are written (on CPU safetensors refuses the shared storage).
  A duplicated `lm_head.weight` is dropped only if it is bitwise equal to the embeddings.

Memory stays bounded by a few fixed 16 MiB buffers per shard writer whatever the tensor or model
size: tensors are copied (or cast) chunk by chunk with `pread`, not through a memory map, because
pages touched through a map count in the process RSS for as long as the file stays mapped. sha256
of every output file is computed on the bytes as they are written, in a helper thread so hashing
overlaps disk I/O. One sha256 stream runs at about 1.4 GB/s a core (SHA-NI), slower than a fast
disk, so up to `workers` output shards (one per CPU, at most 4) are written at once, each with its
own hasher. `safetensors.safe_open` validates every input header with the reference parser.

    python -m tasks.core.models.convert SRC_DIR DST_DIR [--dtype bf16] [--max-shard-size 5GB] [--config FILE]

Modules, in the order a conversion runs:

- dtypes.py      tables of dtypes, sizes and file names
- source.py      reading and validating the input
- plan.py        every key, shape and dtype checked against the family registry; shards laid out
- write.py       hashed, parallel shard writing
- api.py         `convert_checkpoint`, its report, `load_state_dict_from_dir`
- proof.py       `prove_weights`: every written tensor bitwise the source's cast to the output dtype
- state_view.py  a layout-neutral view of a training checkpoint's state (masters, AdamW), read piece by piece

`__main__.py` is the command line.
"""

from __future__ import annotations

from tasks.core.models.convert.api import ConversionReport, convert_checkpoint, load_state_dict_from_dir
from tasks.core.models.convert.dtypes import (
    CONFIG_NAME,
    DTYPE_ALIASES,
    GENERATION_CONFIG_NAME,
    PICKLE_INDEX_NAME,
    PICKLE_WEIGHTS_NAME,
    SAFE_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    ST_TO_TORCH,
    TORCH_TO_ST,
    parse_size,
)
from tasks.core.models.convert.plan import plan_shards, shard_name
from tasks.core.models.convert.source import read_safetensors_header
from tasks.core.models.families import FAMILIES, LAYER_PREFIX, ModelFamily, TensorRule, expected_tensors, tied_keys

__all__ = [
    "CONFIG_NAME",
    "DTYPE_ALIASES",
    "FAMILIES",
    "GENERATION_CONFIG_NAME",
    "LAYER_PREFIX",
    "PICKLE_INDEX_NAME",
    "PICKLE_WEIGHTS_NAME",
    "SAFE_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "ST_TO_TORCH",
    "TORCH_TO_ST",
    "ConversionReport",
    "ModelFamily",
    "TensorRule",
    "convert_checkpoint",
    "expected_tensors",
    "load_state_dict_from_dir",
    "parse_size",
    "plan_shards",
    "read_safetensors_header",
    "shard_name",
    "tied_keys",
]
