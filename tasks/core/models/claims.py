"""What config.json claims against what the weight files hold, read from their safetensors headers
alone, before any tensor table is built or any model constructed.

    python -c "from pathlib import Path; from tasks.core.models.claims import held_weights; print(held_weights(Path('build/demo-inputs/tiny-llama')).layers())"

Everything later reads config.json's sizes: the family's tensor table has one row per layer (so
`num_hidden_layers: 1000000` is twelve million rows), a derived family builds every layer on the
meta device, the estimates multiply the sizes. So the sizes are judged first, and every reader
after this one works on sizes the files bound:
- each size field present is a whole number >= 1 (a zero, a negative, a float or a string is named:
  transformers would either fail deep inside its config class or build a model of no layers);
- the decoder layers config.json claims are layers the files hold (a numbered `<prefix><i>.` in the
  tensor names: the one with the most indices);
- no width config.json claims (hidden, vocabulary, MLP, heads, head_dim) is wider than the widest
  dimension of any tensor in the files: every one of them is the size of some weight's dimension;
- a registered family's parameter count (its table, once the two above bound it) is at most twice
  what the files hold (`FAR_BEYOND`): within that, a size the shapes disagree on is named tensor by
  tensor by `shapes.weight_shape_problems`.
And the files' dtypes: a weight (`*.weight`, a 1-d `*.bias`) must be a float the run trains from
(F32, BF16, F16, F64; `TRAINABLE_DTYPES`). An integer weight fails inside from_pretrained naming no
tensor; an 8-bit float checkpoint carries per-block scales (`weight_scale_inv`) that loading it as
bf16/fp32 would drop. Integer buffers transformers ignores (`position_ids`, an attention mask's
`attn.bias`) are left alone.

Pure reading of headers (`folder.checked_safetensors_header`, bounded; an fsspec folder's and a Hub
model's through ranged reads, `fs_held_weights`, `hub_held_weights`): its cost grows with the headers,
never with what config.json claims. Pickle weights list no shapes without unpickling: their bytes
bound the claim instead (`byte_problems`). Pre-flight runs it before any other check reads config.json's
sizes (`check_model_claims`), load_from_hf on the files it fetched before anything else reads them
(`shapes.folder_refusals`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.core.models.sizes import FIX, WIDTH_FIELDS, is_size, layer_count, size_problems

# safetensors dtypes a weight may have: what from_pretrained loads into the fp32/bf16/fp16 the run trains in
TRAINABLE_DTYPES = ("F32", "BF16", "F16", "F64")
# A registered family's count over the files' parameters beyond which config.json describes another model
FAR_BEYOND = 2
_LAYER_KEY = re.compile(r"^(.*?\.)(\d+)\.")
# Buffers some savers keep beside the weights, which from_pretrained drops (integer or bool ones included)
IGNORED_BUFFERS = ("rotary_emb.inv_freq", "position_ids", "attn.bias", "attn.masked_bias")


@dataclass(frozen=True)
class HeldWeights:
    """What the top-level safetensors files of a folder hold, from their headers only."""

    tensors: dict[str, tuple[str, tuple[int, ...], str]] = field(default_factory=dict)  # key -> (dtype, shape, file)

    @property
    def parameters(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.tensors.values())

    @property
    def bytes(self) -> int:
        from tasks.core.models.folder import SAFETENSORS_DTYPE_BYTES

        return sum(math.prod(s) * SAFETENSORS_DTYPE_BYTES.get(d, 1) for d, s, _ in self.tensors.values())

    def layers(self) -> tuple[str, int]:
        """(prefix, count) of the numbered decoder layers: the `<prefix><i>.` with the most indices; ('', 0) if none."""
        indices: dict[str, set[int]] = {}
        for key in self.tensors:
            if m := _LAYER_KEY.match(key):
                indices.setdefault(m.group(1), set()).add(int(m.group(2)))
        if not indices:
            return "", 0
        prefix = max(indices, key=lambda p: len(indices[p]))
        return prefix, len(indices[prefix])

    def widest(self) -> tuple[int, str]:
        """(the widest dimension of any tensor, its key); (0, '') when the files hold none."""
        return max(((max(s, default=0), k) for k, (_, s, _) in self.tensors.items()), default=(0, ""))


def held_weights(root: Path) -> HeldWeights:
    """The tensors of `root`'s top-level `*.safetensors` files (a file that is not well formed adds
    none: `folder.safetensors_problems` names it)."""
    from tasks.core.models.folder import checked_safetensors_header, top_level_names

    tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for name in top_level_names(root):
        if not name.endswith(".safetensors"):
            continue
        header, _ = checked_safetensors_header(root / name)
        for key, entry in (header or {}).items():
            if key != "__metadata__":
                tensors[key] = (str(entry["dtype"]), tuple(int(d) for d in entry["shape"]), name)
    return HeldWeights(tensors)


# What is read of a Hub model's weights before load_from_hf downloads them: each top-level shard's header
# through one ranged GET, its length bounded first (huggingface_hub's own header limit), the whole read
# under one deadline (a server that trickles bytes cannot hold pre-flight)
HUB_HEADER_LIMIT = 25_000_000
HUB_READ_SECONDS = 30.0


def hub_held_weights(repo: str, revision: str, files: list[str], timeout: float = HUB_READ_SECONDS) -> HeldWeights:
    """The tensors of a Hub repo's top-level `*.safetensors` files, from their headers alone (ranged GETs:
    the Hub serves the first bytes of a file). Raises OSError/ValueError when a header cannot be read."""
    import json
    import time

    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    if constants.HF_HUB_OFFLINE:
        raise OSError("HF_HUB_OFFLINE is set")
    deadline = time.monotonic() + timeout
    tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for name in sorted(f for f in files if f.endswith(".safetensors") and "/" not in f):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the shards' headers were not read within {timeout:g} s (at {name})")
        url = hf_hub_url(repo, name, revision=revision)
        headers = {**build_hf_headers(), "Range": f"bytes=0-{HUB_HEADER_LIMIT + 7}"}
        data, want = b"", 8
        with get_session().get(url, headers=headers, stream=True, timeout=min(10.0, timeout)) as response:
            hf_raise_for_status(response)
            for chunk in response.iter_content(chunk_size=1 << 16):
                data += chunk
                if len(data) >= 8 and want == 8:
                    want = 8 + int.from_bytes(data[:8], "little")
                    if want - 8 > HUB_HEADER_LIMIT:
                        raise ValueError(f"{name} claims a {want - 8:,}-byte header (over {HUB_HEADER_LIMIT:,})")
                if len(data) >= want or time.monotonic() > deadline:
                    break
        if len(data) < want:
            raise TimeoutError(f"{name}: its header was not read whole within {timeout:g} s")
        header = json.loads(data[8:want])
        for key, entry in header.items() if isinstance(header, dict) else ():
            if key != "__metadata__":
                tensors[key] = (str(entry["dtype"]), tuple(int(d) for d in entry["shape"]), name)
    return HeldWeights(tensors)


def fs_held_weights(uri: str, files: list[str]) -> HeldWeights:
    """The tensors of the top-level `*.safetensors` files of an fsspec folder (s3://, gs://, ...), from
    their headers alone: 8 bytes, then the header, its length bounded first (ranged reads)."""
    import json

    from fsspec.core import url_to_fs

    from tasks.core.models.folder import SAFETENSORS_MAX_HEADER

    fs, root = url_to_fs(uri)
    tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for name in sorted(f for f in files if f.endswith(".safetensors") and "/" not in f):
        with fs.open(f"{root.rstrip('/')}/{name}", "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > SAFETENSORS_MAX_HEADER:
                raise ValueError(f"{name} claims a {n:,}-byte header (over {SAFETENSORS_MAX_HEADER:,})")
            header = json.loads(f.read(n))
        for key, entry in header.items() if isinstance(header, dict) else ():
            if key != "__metadata__":
                tensors[key] = (str(entry["dtype"]), tuple(int(d) for d in entry["shape"]), name)
    return HeldWeights(tensors)


def weight_file_bytes(root: Path) -> int:
    """The bytes of a folder's top-level pickle weight files, from the file system, when it has no
    safetensors (whose headers list their tensors); 0 otherwise."""
    from tasks.core.models.folder import PICKLE_SUFFIXES, top_level_names

    names = top_level_names(root)
    if any(n.endswith(".safetensors") for n in names):
        return 0
    return sum((root / n).stat().st_size for n in names if n.endswith(PICKLE_SUFFIXES))


def byte_problems(config: Mapping[str, Any], weight_bytes: int, where: str) -> list[tuple[str, str]]:
    """What weights whose tensors are not listed (pickle files, whose shapes only unpickling tells) bound:
    every decoder layer holds at least one hidden-wide tensor (its norm) and the embedding vocab x hidden
    values, each at least a byte, so a config.json whose layers x hidden or vocab x hidden exceeds the
    files' bytes describes a model they cannot hold."""
    hidden = next((config[f] for f in ("hidden_size", "n_embd", "d_model") if is_size(config.get(f))), None)
    if hidden is None or weight_bytes <= 0:
        return []
    out = []
    from tasks.core.errors import ConversionError
    from tasks.core.models.families import FAMILIES, count_parameters

    if config.get("model_type") in FAMILIES:  # its count is exact, and counted in time independent of the layers
        try:
            claimed = count_parameters(config)
        except (ConversionError, KeyError, TypeError, ValueError):
            claimed = 0  # missing dims: the model-family check names them
        if claimed > weight_bytes:
            out.append(
                (
                    "config.json",
                    (
                        f"{where} describes a {config['model_type']} model of {claimed:,} parameters, more than its "
                        f"weight files' {weight_bytes:,} bytes can hold (a byte each at the least): {FIX}"
                    ),
                )
            )
            return out
    layers = layer_count(config)
    for name, value in ([layers] if layers else []) + [("vocab_size", config.get("vocab_size"))]:
        if is_size(value) and value * hidden > weight_bytes:
            out.append(
                (
                    name,
                    (
                        f"{where} {name}={value:,} x hidden size {hidden:,} is more values than its weight files' "
                        f"{weight_bytes:,} bytes can hold: {FIX}"
                    ),
                )
            )
    return out


def claim_problems(
    config: Mapping[str, Any], held: HeldWeights, where: str = "config.json", weight_bytes: int = 0
) -> list[tuple[str, str]]:
    """(field, sentence) for each size config.json claims that its weight files cannot hold, naming the
    field, its value, what the files hold and the fix; [] when every claim is within them. Files whose
    headers list no tensor (pickle weights) are judged by their bytes (`weight_bytes`, `byte_problems`)."""
    out = size_problems(config, where)
    if out:
        return out
    if not held.tensors:
        return byte_problems(config, weight_bytes, where)
    prefix, layers = held.layers()
    if (claimed := layer_count(config)) and claimed[1] > layers:
        name, value = claimed
        if layers:
            holds = f"{layers} layers ({prefix}0 to {prefix}{layers - 1}) in {len(held.tensors)} tensors"
            fix = f"set {name}: {layers} if these are the model's weights, else {FIX}"
        else:
            holds = f"no numbered decoder layer ({len(held.tensors)} tensors)"
            fix = FIX
        out.append(
            (name, f"{where} {name}={value:,} claims more decoder layers than its weight files hold: {holds}; {fix}")
        )
    widest, key = held.widest()
    for name in WIDTH_FIELDS:
        value = config.get(name)
        if is_size(value) and value > widest:
            out.append(
                (
                    name,
                    (
                        f"{where} {name}={value:,} is wider than any tensor its weight files hold (the widest dimension "
                        f"is {widest:,}, of {key}); every {name} is some weight's dimension, so these files cannot hold "
                        f"that model: {FIX}"
                    ),
                )
            )
    if out:
        return out
    from tasks.core.errors import ConversionError
    from tasks.core.models.families import FAMILIES, count_parameters

    if config.get("model_type") in FAMILIES:  # a derived table would build the model: its shapes are compared later
        try:
            claimed_params = count_parameters(config)
        except (ConversionError, KeyError, TypeError, ValueError):
            return out  # missing dims: the model-family check names them
        if claimed_params > FAR_BEYOND * held.parameters:
            out.append(
                (
                    "config.json",
                    (
                        f"{where} describes a {config.get('model_type')} model of {claimed_params:,} parameters, but its "
                        f"weight files hold {held.parameters:,} ({held.bytes:,} bytes); one of its sizes is not these "
                        f"weights' (the tensor shapes name which): {FIX}"
                    ),
                )
            )
    return out


def weight_dtype_problems(held: HeldWeights, root: Path | str, most: int = 3) -> list[str]:
    """One sentence per file holding a weight whose dtype the run does not train from (`TRAINABLE_DTYPES`),
    naming the file, a few tensors with their dtypes, how many more, and the fix."""
    bad: dict[str, list[tuple[str, str]]] = {}
    for key, (dtype, shape, name) in held.tensors.items():
        weight = key.endswith(".weight") or (key.endswith(".bias") and len(shape) == 1)
        if dtype in TRAINABLE_DTYPES or not weight or key.endswith(IGNORED_BUFFERS):
            continue
        bad.setdefault(name, []).append((key, dtype))
    out = []
    for name, found in sorted(bad.items()):
        dtypes = sorted({d for _, d in found})
        said = ", ".join(f"{k} ({d})" for k, d in found[:most])
        more = f" and {len(found) - most} more" if len(found) > most else ""
        if all(d.startswith("F8") for d in dtypes):
            why = (
                "8-bit floats: a quantized checkpoint, whose per-block scales loading it as the run's fp32/bf16/fp16 "
                "would drop; use the model's bf16 or fp16 release, or dequantize it with its scales and save it in bf16"
            )
        else:
            why = (
                "not floats: from_pretrained cannot make a trainable parameter of them (it fails naming no tensor); "
                "these are not a model's trained weights: restore the file from the model's source"
            )
        out.append(
            f"{Path(root) / name} holds weights in {', '.join(dtypes)}: {said}{more}; the run trains from "
            f"{', '.join(TRAINABLE_DTYPES)} weights, and these are {why}"
        )
    return out
