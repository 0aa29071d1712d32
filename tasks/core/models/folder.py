"""Which files may sit in an HF model folder: the one rule the export, `cpt-to-sft verify`, the
push and pre-flight apply alike, and a model folder's code (`auto_map`, `*.py`) kept out of them.

    python -c "from pathlib import Path; from tasks.core.models.folder import folder_problems; print(folder_problems(Path('runs/demo/export')))"

Serving engines (vLLM, SGLang) and `from_pretrained` read the folder's top level: without an
index they load every `*.safetensors` there as weights, and a PEFT adapter beside merged weights
makes loaders apply it (or refuse) on top of weights it was already merged into. So a folder whose
top level holds weights may hold, as `.safetensors`, only its weight shards (the index's
`weight_map` values, else `model.safetensors`), and no adapter files. A file must also be what its
name says (`misnamed`): a `*.model` is a SentencePiece model (a protobuf whose every top-level
field is one of ModelProto's), never, say, a GGUF file left over from a conversion, and weights in
a format no HF loader reads (`*.gguf`, `*.ggml`) or pickles beside safetensors are not the
folder's. load_from_hf leaves such files out of `base/`, the tokenizer copy leaves them out of
`cpt/hf/` and `export/`, and the rule refuses them where it is applied. Subfolders (the provenance
folder `.cpt-to-sft/`, a plugin checkpoint's `model/`) are not what a loader globs, so the rule
looks at the top level only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# The file names of an HF model folder, spelled here (the converter, tasks.core.models.convert.dtypes,
# reads them from this module): the rule needs no converter, so checking a folder imports no torch.
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
# The model's JSON files every stage reads: pre-flight and load_from_hf refuse a broken one, naming it.
JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
FOREIGN_WEIGHT_SUFFIXES = (".gguf", ".ggml")  # quantized weights of other runtimes: no HF loader reads them
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# config.json's weight dtype: transformers 4.56+ writes it as `dtype`, earlier releases (and most Hub folders)
# as `torch_dtype`; 4.56+ reads either and keeps `dtype` when both are there.
CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")


def config_dtype(config: dict[str, Any], default: str = "float32") -> str:
    """The weight dtype a config.json names (`float32`, `bfloat16`, ...), under either key."""
    return str(next((config[k] for k in CONFIG_DTYPE_KEYS if config.get(k)), default))


def set_config_dtype(config: dict[str, Any], name: str) -> None:
    """Name the weight dtype under both keys: a stale `dtype` would win over a new `torch_dtype` on 4.56+, and
    loaders built on older transformers read `torch_dtype` only."""
    for key in CONFIG_DTYPE_KEYS:
        config[key] = name


# First bytes of formats a misnamed file turns out to be, for the message.
MAGICS = (
    (b"GGUF", "a GGUF file"),
    (b"ggml", "a GGML file"),
    (b"PK\x03\x04", "a zip archive (a torch.save file)"),
    (b"\x80", "a pickle"),
    (b"\x89HDF", "an HDF5 file"),
    (b"{", "JSON text"),
)
# SentencePiece's ModelProto: pieces=1, trainer_spec=2, normalizer_spec=3, self_test_data=4,
# denormalizer_spec=5, all length-delimited (protobuf wire type 2).
_SP_FIELDS = frozenset({1, 2, 3, 4, 5})


def _varint(f) -> int | None:
    shift = value = 0
    while shift < 64:
        b = f.read(1)
        if not b:
            return None
        value |= (b[0] & 0x7F) << shift
        if b[0] < 0x80:
            return value
        shift += 7
    return None


def sentencepiece_problem(path: Path) -> str | None:
    """Why `path` is not a SentencePiece model, or None: its top-level protobuf fields are walked
    (tags and lengths only, seeking past each value), so a 100 MB impostor is judged by its first bytes."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        for magic, what in MAGICS:
            if head.startswith(magic):
                return f"it is {what} (its first bytes are {head[:4]!r}), not a SentencePiece model"
        f.seek(0)
        pieces = 0
        while f.tell() < size:
            at, tag = f.tell(), _varint(f)
            if tag is None or tag >> 3 not in _SP_FIELDS or tag & 7 != 2:
                return f"byte {at} is not a field of a SentencePiece model (first bytes {head[:4]!r})"
            length = _varint(f)
            if length is None or f.tell() + length > size:
                return f"a field at byte {at} runs past the end of the file: truncated, or not a SentencePiece model"
            pieces += tag >> 3 == 1
            f.seek(length, 1)
    return None if pieces else "it holds no vocabulary piece: empty, or not a SentencePiece model"


def misnamed(folder: Path, names: Iterable[str] | None = None) -> dict[str, str]:
    """{file name: why it does not belong} for the top-level files that are not what their name says
    or are weights the folder's loader would not read; {} when every file is what it claims."""
    names = sorted({n for n in (top_level_names(folder) if names is None else names) if "/" not in n})
    has_safetensors = any(n.endswith(".safetensors") for n in names)
    out: dict[str, str] = {}
    for name in names:
        if name.endswith(".model") and (folder / name).is_file():
            why = sentencepiece_problem(folder / name)
            if why:
                out[name] = f"named like a SentencePiece tokenizer model, but {why}"
        elif name.endswith(FOREIGN_WEIGHT_SUFFIXES):
            out[name] = "weights in a format no HF loader reads (GGUF/GGML)"
        elif has_safetensors and name.endswith(PICKLE_SUFFIXES) and name not in ADAPTER_FILES:
            out[name] = "a pickle file beside the safetensors weights, which are what every stage reads"
    try:
        strays = weight_shards(folder, names)
    except ValueError:
        strays = None  # an unreadable index: folder_problems names it
    for name in names:
        if strays is not None and name.endswith(".safetensors") and name not in strays and name not in ADAPTER_FILES:
            out[name] = "a .safetensors file that is not a weight shard of the model (the index does not name it)"
    return out


def json_file_problem(path: Path) -> str | None:
    """Why a model's JSON file does not parse (the parse error, its line and column; tokenizer.json
    also through the tokenizers library every stage loads it with), or None."""
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text ({exc})"
    except json.JSONDecodeError as exc:
        size = path.stat().st_size
        cut = " (it ends there: the file is truncated)" if exc.pos >= len(text.rstrip()) else ""
        return f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}{cut}; {size} bytes"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if path.name == "tokenizer.json":
        from tokenizers import Tokenizer  # the Rust library alone: no transformers import in pre-flight

        try:
            Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception with serde's message
            return f"parses as JSON but is not a tokenizer the tokenizers library loads ({str(exc).splitlines()[0]})"
    return None


# safetensors' own header limit (safetensors/src/tensor.rs MAX_HEADER_SIZE); a header is a few hundred KB
SAFETENSORS_MAX_HEADER = 100_000_000
SAFETENSORS_DTYPE_BYTES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64", "C64"), 8),
}


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a well-formed safetensors file, or None (`checked_safetensors_header`)."""
    return checked_safetensors_header(path)[1]


def checked_safetensors_header(path: Path) -> tuple[dict[str, Any], None] | tuple[None, str]:
    """(header, None) for a well-formed safetensors file, else (None, why): its 8-byte header length is read
    and bounded before the header is, the header parses as JSON, and every tensor's byte range lies
    in the file, matches its dtype and shape, and the ranges tile the data with no gap or overlap
    (what the safetensors loader checks, said here with the file's name before anything loads it)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None, f"is {size} bytes, too short for a safetensors file (an 8-byte header length comes first)"
        n = int.from_bytes(head, "little")
        if n > SAFETENSORS_MAX_HEADER:
            return None, (
                f"claims a {n:,}-byte header (header too large: safetensors' limit is {SAFETENSORS_MAX_HEADER:,}): "
                "corrupt, or not a safetensors file"
            )
        if 8 + n > size:
            return None, f"claims a {n:,}-byte header but holds {size:,} bytes: truncated, or not a safetensors file"
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return None, f"has a header that is not JSON ({exc}): corrupt, or not a safetensors file"
    if not isinstance(header, dict):
        return None, "has a header that is not a JSON object: corrupt, or not a safetensors file"
    data, ranges = size - 8 - n, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            count = 1
            for dim in entry["shape"]:
                count *= int(dim)
            width = SAFETENSORS_DTYPE_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            return None, f"describes tensor {name!r} without a known dtype, a shape and two data_offsets: corrupt"
        if not 0 <= begin <= end <= data:
            return (
                None,
                f"places tensor {name!r} at bytes {begin}-{end} of its {data:,} data bytes: truncated or corrupt",
            )
        if end - begin != count * width:
            return (
                None,
                f"gives tensor {name!r} {end - begin} bytes where its dtype and shape need {count * width}: corrupt",
            )
        ranges.append((begin, end))
    at = 0
    for begin, end in sorted(ranges):
        if begin != at:
            return (
                None,
                f"has {'overlapping' if begin < at else 'unlisted'} data at byte {min(begin, at)} of its tensors: corrupt",
            )
        at = end
    if at != data:
        return None, f"has {data - at:,} bytes after its last tensor: truncated or corrupt"
    return header, None


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor: shape} from the header of a well-formed safetensors file; {} for one that is not
    (`safetensors_problem` names it)."""
    header, _ = checked_safetensors_header(path)
    return {k: tuple(int(d) for d in v["shape"]) for k, v in (header or {}).items() if k != "__metadata__"}


def safetensors_problems(folder: Path) -> dict[str, str]:
    """{file name: why} for every top-level `*.safetensors` of `folder` that is not well formed."""
    return {
        name: why
        for name in top_level_names(folder)
        if name.endswith(".safetensors") and (why := safetensors_problem(folder / name))
    }


# A model folder's own code: transformers imports it where a config's `auto_map` names it and
# trust_remote_code is set. This project runs no model folder's code: no .py file is copied into
# base/ (nor, so, any later folder), and every `auto_map` is removed, with a line (`strip_auto_map`).
CODE_SUFFIXES = (".py", ".pyc")
AUTO_MAP = "auto_map"


def is_code(name: str) -> bool:
    return name.endswith(CODE_SUFFIXES)


def auto_map_paths(data: Any, prefix: str = "") -> list[str]:
    """The key path of every `auto_map` in a parsed JSON config, nested sections (text_config,
    vision_config, ...) and lists included."""
    out: list[str] = []
    if isinstance(data, dict):
        for key, value in data.items():
            where = f"{prefix}.{key}" if prefix else str(key)
            if key == AUTO_MAP:
                out.append(where)
            else:
                out += auto_map_paths(value, where)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out += auto_map_paths(value, f"{prefix}[{i}]")
    return out


def _configs(folder: Path, names: Iterable[str] | None) -> list[str]:
    """The top-level JSON files transformers reads an `auto_map` from: config.json, tokenizer_config.json,
    generation_config.json, processor_config.json, preprocessor_config.json, ..."""
    names = top_level_names(folder) if names is None else names
    return sorted(n for n in set(names) if "/" not in n and n.endswith("config.json") and (folder / n).is_file())


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None  # a broken file is json_file_problem's to name


def auto_map_entries(folder: Path, names: Iterable[str] | None = None) -> list[str]:
    """'<file> <key path>' of every `auto_map` in the folder's config files."""
    return [f"{n} {p}" for n in _configs(folder, names) for p in auto_map_paths(_read_json(folder / n))]


def _without_auto_map(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _without_auto_map(v) for k, v in data.items() if k != AUTO_MAP}
    if isinstance(data, list):
        return [_without_auto_map(v) for v in data]
    return data


def strip_auto_map(folder: Path) -> list[str]:
    """Remove every `auto_map` from the folder's config files (rewritten, keys in order); returns
    what was removed ('<file> <key path>'), for the log line and the manifest."""
    removed: list[str] = []
    for name in _configs(folder, None):
        data = _read_json(folder / name)
        paths = auto_map_paths(data)
        if paths:
            (folder / name).write_text(json.dumps(_without_auto_map(data), indent=2, ensure_ascii=False) + "\n")
            removed += [f"{name} {p}" for p in paths]
    return removed


def top_level_names(folder: Path) -> list[str]:
    """The plain files directly in `folder` (what a weight loader's glob sees)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def weight_shards(folder: Path, names: Iterable[str]) -> set[str] | None:
    """The weight files the folder declares (index's weight_map values, else model.safetensors),
    or None when it holds no merged weights at all (not an HF model folder)."""
    names = set(names)
    if SAFE_INDEX_NAME in names:
        try:
            return set(json.loads((folder / SAFE_INDEX_NAME).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{folder / SAFE_INDEX_NAME}: unreadable weight index ({type(exc).__name__}: {exc}); rebuild the "
                "folder (delete it and re-run its stage)"
            ) from None
    return {SAFE_WEIGHTS_NAME} if SAFE_WEIGHTS_NAME in names else None


def folder_problems(folder: Path, names: Iterable[str] | None = None, require_weights: bool = True) -> list[str]:
    """Every violation of the rule, each a sentence naming the file and the fix; [] when clean.

    `names`: the relative paths to judge (a manifest's files, what a push sends); by default the
    files on disk. Only top-level names count; without merged weights nothing is judged.
    `require_weights=False` leaves a missing shard to the manifest check that owns it.
    """
    names = sorted({n for n in (top_level_names(folder) if names is None else names) if "/" not in n})
    weights = weight_shards(folder, names)
    if weights is None:
        return []
    fix = "delete it, or rebuild the folder (delete it and re-run its stage)"
    out = []
    for name in names:
        if name in ADAPTER_FILES:
            out.append(
                f"{folder} holds {name}: adapter files beside merged weights (loaders would apply the adapter on top "
                f"of weights it is already merged into); {fix}"
            )
        elif name.endswith(".safetensors") and name not in weights:
            out.append(
                f"{folder} holds {name}: a .safetensors file that is not a weight shard of the model "
                f"(serving engines such as vLLM and SGLang load every *.safetensors in the folder as weights); {fix}"
            )
    for name, why in misnamed(folder, names).items():
        if not name.endswith(".safetensors"):  # a stray shard is said above
            out.append(f"{folder} holds {name}: {why}; {fix}")
    for name in names:
        if is_code(name):
            out.append(
                f"{folder} holds {name}: Python code, which a loader with trust_remote_code would run; no model "
                f"folder of this project carries code: {fix}"
            )
    for entry in auto_map_entries(folder, names):
        out.append(
            f"{folder}: {entry} names Python code for loaders to run (auto_map); no model folder of this project "
            f"carries it: remove the entry, or rebuild the folder (delete it and re-run its stage)"
        )
    missing = sorted(weights - set(names))
    if missing and require_weights:
        named_by = SAFE_INDEX_NAME if SAFE_INDEX_NAME in names else "the folder"
        out.append(
            f"{folder} lacks weight file(s) {', '.join(missing)} that {named_by} names; rebuild the folder (delete it "
            "and re-run its stage)"
        )
    return out
