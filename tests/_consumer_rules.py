"""The rules the common consumers of a model folder apply, as one assertion helper.

- vLLM's and SGLang's default loaders: without `model.safetensors.index.json` they load EVERY
  `*.safetensors` in the folder; with it, the files the index names.
- Every tensor they meet must be a parameter of the model `config.json` describes (built on the
  meta device, tied weights counted once), and no parameter may be missing.
- Every shard's safetensors metadata says `format: pt`, as `save_pretrained` writes it.
- `from_pretrained(..., output_loading_info=True)` reports no missing, unexpected or mismatched
  keys (it only warns on unexpected ones, so the info is what is asserted).
"""

from __future__ import annotations

import json
from pathlib import Path

INDEX = "model.safetensors.index.json"


def served_files(folder: Path) -> list[str]:
    if (folder / INDEX).is_file():
        return sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    return sorted(p.name for p in folder.glob("*.safetensors"))


def assert_consumer_rules(folder: Path) -> dict:
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    files = served_files(folder)
    assert files, f"{folder}: no weight files"
    names: dict[str, str] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            assert (f.metadata() or {}).get("format") == "pt", (
                f"{name}: safetensors metadata {f.metadata()} lacks format: pt"
            )
            for key in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                assert key not in names, f"{key} in both {names[key]} and {name}"
                names[key] = name
    # No other *.safetensors anywhere in the folder (the Hub would count it as weights).
    every = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.safetensors"))
    assert every == files, f"{folder}: *.safetensors outside the weights: {sorted(set(every) - set(files))}"

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())  # tied weights appear once
    assert set(names) <= set(params), f"tensors that are no parameter of the model: {sorted(set(names) - set(params))}"
    assert set(params) <= set(names), f"parameters missing from the weights: {sorted(set(params) - set(names))}"
    del model

    loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), f"from_pretrained {kind}: {info.get(kind)}"
    del loaded
    return {"files": files, "tensors": len(names)}
