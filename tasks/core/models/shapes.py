"""The shapes of a model folder people bring from the Hub, each run or refused before launch naming
the file and the fix: GGUF-only folders, sharded weights with `model.safetensors.index.json`,
`chat_template.jinja` beside the tokenizer, several eos ids, and a multimodal `config.json` whose
text model sits in `text_config`.

    python -c "from tasks.core.models.shapes import text_model_type; print(text_model_type({'model_type': 'gemma3', 'text_config': {'model_type': 'gemma3_text'}}))"

What runs: shards with their index (every stage reads the index), `chat_template.jinja` (the
installed transformers' tokenizer reads it over tokenizer_config.json's `chat_template`, and every
folder the run writes copies it), several eos ids (the export keeps them all and adds the chat
template's end of turn). What is refused, with the conversion that makes it run: GGUF weights (no
HF loader reads them: transformers' GGUF reader, `gguf_file=`, converts them offline), a
`text_config` checkpoint (the run trains text-only causal LMs from a flat config: its
`language_model`, a model of `text_config.model_type`, is saved on its own), an index naming a
shard the folder lacks, an eos id outside the vocabulary, weight files lacking tensors config.json's
family gives the model or holding tensors it has no place for (`key_problems`, naming the registered
family the files' layer looks like). `chat_template.json` (a processor's file)
is named: the tokenizer never reads it. Pure reading, no torch: pre-flight calls it.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"  # transformers' tokenization_utils_base CHAT_TEMPLATE_FILE
CHAT_TEMPLATE_JSON = "chat_template.json"  # a processor's template file: no tokenizer reads it
GGUF_HEAD_BYTES = 1 << 20  # general.architecture is among the first keys; never read more of an untrusted file
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_files(names: Iterable[str]) -> list[str]:
    return sorted(n for n in names if n.lower().endswith(GGUF_SUFFIX))


def gguf_architecture(path: Path) -> str | None:
    """`general.architecture` from a GGUF file's header, or None: at most GGUF_HEAD_BYTES are read
    and walked key by key (an array of strings, a vocabulary, is skipped by its lengths), so a
    malformed or huge file is judged by its head."""
    try:
        with open(path, "rb") as f:
            buf = f.read(GGUF_HEAD_BYTES)
    except OSError:
        return None
    if buf[:4] != b"GGUF" or len(buf) < 24:
        return None
    (n_kv,) = struct.unpack_from("<Q", buf, 16)
    at = 24

    def string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        if pos + 8 + n > len(buf):
            raise ValueError("past the head")
        return buf[pos + 8 : pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

    def skip(kind: int, pos: int) -> int:
        if kind in _GGUF_SCALARS:
            return pos + _GGUF_SCALARS[kind]
        if kind == _GGUF_STRING:
            return string(pos)[1]
        if kind == _GGUF_ARRAY:
            item, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if item in _GGUF_SCALARS:
                return pos + count * _GGUF_SCALARS[item]
            for _ in range(count):
                pos = skip(item, pos)
                if pos > len(buf):
                    raise ValueError("past the head")
            return pos
        raise ValueError(f"unknown GGUF value type {kind}")

    try:
        for _ in range(min(n_kv, 256)):
            key, at = string(at)
            (kind,) = struct.unpack_from("<I", buf, at)
            at += 4
            if key == "general.architecture" and kind == _GGUF_STRING:
                return string(at)[0]
            at = skip(kind, at)
    except (struct.error, ValueError):
        return None
    return None


def gguf_readable_architectures() -> list[str] | None:
    """The architectures the installed transformers' GGUF reader converts, read from its source
    (`integrations/ggml.py` GGUF_CONFIG_MAPPING) without importing it (that import pulls in torch)."""
    try:
        spec = importlib.util.find_spec("transformers")
        source = Path(spec.origin).parent / "integrations" / "ggml.py"
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "GGUF_CONFIG_MAPPING" for t in node.targets
            ):
                keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
                return [k for k in keys if k not in ("general", "tokenizer", "tokenizer_config")]
    except (AttributeError, ImportError, OSError, SyntaxError, TypeError, ValueError):
        return None
    return None


def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "(not installed)"


def gguf_refusal(where: str, names: Iterable[str], root: Path | None = None) -> str:
    """Why a folder whose weights are GGUF only cannot run, and the offline conversion that makes it run."""
    ggufs = gguf_files(names)
    first = ggufs[0]
    arch = gguf_architecture(root / first) if root is not None else None
    readable = gguf_readable_architectures()
    version = _transformers_version()
    reader = ""
    if arch and readable is not None and arch not in readable:
        reader = (
            f" Its architecture is {arch!r} (GGUF general.architecture), which the installed transformers {version}'s "
            f"GGUF reader does not convert (it reads {', '.join(readable)}): convert in a separate environment with a "
            "transformers whose reader lists it."
        )
    elif arch:
        reader = f" Its architecture is {arch!r} (GGUF general.architecture)."
    return (
        f"{where} holds GGUF weights only ({', '.join(ggufs[:3])}{', ...' if len(ggufs) > 3 else ''}): no HF loader "
        "trains from GGUF, and a quantized GGUF is dequantized when converted (fine-tune from the model's original "
        "safetensors where they exist). Convert it offline with transformers' GGUF reader (pip install gguf): "
        f"`AutoModelForCausalLM.from_pretrained(DIR, gguf_file={first!r}, dtype=torch.float32)"
        f".save_pretrained(OUT)` and `AutoTokenizer.from_pretrained(DIR, gguf_file={first!r}).save_pretrained(OUT)`, "
        f"then set base_model.uri to OUT.{reader}"
    )


def text_model_type(config: dict[str, Any]) -> str | None:
    """The model_type of a nested `text_config` (a multimodal checkpoint's text model), else None."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return None
    kind = text.get("model_type")
    return kind if isinstance(kind, str) and kind else "(unnamed)"


def text_config_refusal(where: str, config: dict[str, Any]) -> str:
    """A multimodal checkpoint used as text-only: the run decides on its text model's family
    (text_config.model_type) and says how to save that model on its own."""
    text = text_model_type(config)
    arch = ", ".join(config.get("architectures") or []) or "(none named)"
    return (
        f"{where}/config.json is a multimodal checkpoint (model_type {config.get('model_type')!r}, architectures "
        f"{arch}) whose text model is in text_config (model_type {text!r}); cpt-to-sft trains a text-only causal LM "
        f"from a flat config.json, so it would train the {text!r} model alone. Save that model on its own and point "
        f"base_model.uri at it: `{save_text_model_recipe()}` "
        f"(OUT/config.json then says model_type {text!r}, the family pre-flight judges)"
    )


def save_text_model_recipe() -> str:
    """How the installed transformers saves a multimodal checkpoint's text model as a causal LM: up to 4.51 its
    `language_model` is that causal LM; later releases make it the bare text model (no head, and saved without the
    `model.` prefix its causal-LM class loads under), the head sitting on the multimodal model."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        causal_lm_inside = version("transformers").startswith("4.51.")
    except PackageNotFoundError:
        causal_lm_inside = False
    start = "m = AutoModelForImageTextToText.from_pretrained(DIR, dtype='auto'); "
    end = "AutoTokenizer.from_pretrained(DIR).save_pretrained(OUT)"
    if causal_lm_inside:
        return start + "m.language_model.save_pretrained(OUT); " + end
    return (
        start + "lm = AutoModelForCausalLM.from_config(m.config.text_config, dtype=m.dtype); "
        "lm.model.load_state_dict(m.language_model.state_dict()); lm.lm_head.load_state_dict(m.lm_head.state_dict()); "
        "lm.save_pretrained(OUT); " + end
    )


def index_problem(root: Path, names: Iterable[str]) -> str | None:
    """A local `model.safetensors.index.json` that does not parse, or names a shard the folder lacks."""
    from tasks.core.models.folder import SAFE_INDEX_NAME, weight_shards

    names = set(names)
    if SAFE_INDEX_NAME not in names:
        return None
    try:
        shards = weight_shards(root, names) or set()
    except ValueError as exc:
        return f"{exc}; restore the file from the model's source (re-download it)"
    missing = sorted(shards - names)
    if missing:
        return (
            f"{root / SAFE_INDEX_NAME} names shard(s) the folder lacks: {', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}; download the missing shard(s) from the model's source"
        )
    return None


def eos_problems(where: str, files: dict[str, dict[str, Any] | None], vocab_size: Any) -> list[str]:
    """Each eos_token_id (one or several) of config.json / generation_config.json is a token id of the vocabulary."""
    out = []
    for name, data in files.items():
        value = (data or {}).get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or i < 0]
        if isinstance(vocab_size, int):
            bad += [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= vocab_size]
        if bad:
            out.append(
                f"{where}/{name} eos_token_id {value!r}: {', '.join(map(repr, bad))} is no token id of the "
                f"vocabulary (0..{vocab_size - 1 if isinstance(vocab_size, int) else '?'}); generation would never "
                f"stop there: correct eos_token_id in {name} from the model's source"
            )
    return out


def template_files(names: Iterable[str], tokenizer_config: dict[str, Any] | None, root: Path | None = None):
    """(notes, warnings) on where the chat template comes from, as the installed tokenizer reads it:
    chat_template.jinja over tokenizer_config.json's `chat_template`, chat_template.json never."""
    names = set(names)
    in_config = (tokenizer_config or {}).get("chat_template")
    notes, warnings = [], []
    if CHAT_TEMPLATE_JINJA in names:
        notes.append(
            f"chat template: {CHAT_TEMPLATE_JINJA} (the tokenizer reads it over tokenizer_config.json's; every folder "
            "the run writes copies it)"
        )
        if in_config and root is not None:
            try:
                differs = (root / CHAT_TEMPLATE_JINJA).read_text() != in_config
            except (OSError, UnicodeDecodeError):
                differs = False
            if differs:
                warnings.append(
                    f"base_model.uri: {root / CHAT_TEMPLATE_JINJA} and tokenizer_config.json's chat_template differ; "
                    f"the tokenizer uses {CHAT_TEMPLATE_JINJA} (SFT and the export render with it): delete the one "
                    "you do not mean"
                )
    if CHAT_TEMPLATE_JSON in names and CHAT_TEMPLATE_JINJA not in names:
        used = "tokenizer_config.json's chat_template is used instead" if in_config else "SFT finds no chat template"
        warnings.append(
            f"base_model.uri: {CHAT_TEMPLATE_JSON} is a processor's file the tokenizer never reads ({used}); to use "
            f'its template, write its "chat_template" string to {CHAT_TEMPLATE_JINJA} beside the tokenizer'
        )
    return notes, warnings


def weight_shape_problems(root: Path, config: dict[str, Any], most: int = 3) -> list[str]:
    """One sentence per top-level safetensors file of `root` holding a tensor whose header shape is not
    the one config.json gives it (the family's tensor table, `expected_tensors`): transformers'
    from_pretrained fails on it (size mismatch) once a stage loads the model. Then one sentence when the
    files lack tensors the table expects or hold tensors it does not (`key_problems`). A file that is not
    well formed is named by the header check (`safetensors_problems`). Call it once `claims.claim_problems`
    passed: the table has a row per layer config.json claims."""
    from tasks.core.errors import ConversionError
    from tasks.core.models.claims import held_weights
    from tasks.core.models.families import expected_tensors, family_of, shape_cause
    from tasks.core.models.folder import safetensors_shapes, top_level_names

    try:
        family, want = family_of(config), expected_tensors(config)
    except (ConversionError, KeyError, TypeError, ValueError):
        return []  # no family or no dimensions: the model-family check names it
    out = []
    for name in sorted(n for n in top_level_names(root) if n.endswith(".safetensors")):
        got = safetensors_shapes(root / name)
        bad = [(k, shape, want[k]) for k, shape in got.items() if k in want and shape != want[k]]
        if not bad:
            continue
        said = "; ".join(
            f"{k} is {list(shape)} where config.json makes it {list(w)} ({shape_cause(k, shape, w, family)})"
            for k, shape, w in bad[:most]
        )
        more = f" (and {len(bad) - most} more)" if len(bad) > most else ""
        out.append(
            f"{root / name}: tensor {said}{more}; transformers would refuse to load it (size mismatch) once a stage "
            f"loads the model: restore the file from the model's source, or point base_model.uri at the folder whose "
            f"config.json ({config.get('model_type')}) these weights were saved with"
        )
    held = held_weights(root)
    if held.tensors:
        out += key_problems(root, config, family, want, set(held.tensors), most)
    return out


def _layer_keys(family) -> tuple[set[str], set[str]]:
    """(the keys every layer of a registered family has, those a config flag adds)."""
    required = {r.key for r in family.layer if r.when is None}
    return required, {r.key for r in family.layer if r.when is not None}


def looks_like(keys: set[str]) -> list[str]:
    """The registered families whose decoder layer has exactly the files' layer-0 tensor names (llama and
    mistral share one); [] when none does, or the files hold no `model.layers.0.`."""
    from tasks.core.models.families import FAMILIES, LAYER_PREFIX

    first = LAYER_PREFIX.format(i=0)
    layer = {k[len(first) :] for k in keys if k.startswith(first)}
    if not layer:
        return []
    out = []
    for name, family in sorted(FAMILIES.items()):
        required, optional = _layer_keys(family)
        if required <= layer <= required | optional:
            out.append(name)
    return out


def key_problems(root: Path, config: dict[str, Any], family, want: dict[str, Any], held: set[str], most: int = 3):
    """The sentence, if any, for weight files that lack tensors config.json's table expects (from_pretrained
    would initialize them at random and train from there) or hold tensors it does not (weights of another
    architecture): a few of each named, the rest counted, and the family the files' layer looks like.
    A file saved from the bare model (no `model.` prefix) matches as from_pretrained maps it; buffers some
    savers keep (`claims.IGNORED_BUFFERS`) and the duplicate of a tied key are not counted."""
    from tasks.core.models.claims import IGNORED_BUFFERS

    base = family.layer_prefix.split(".", 1)[0] + "."  # "model." / "transformer."

    def canonical(key: str) -> str:
        return key if key in want or (base + key) not in want else base + key

    present = {canonical(k) for k in held}
    missing = [k for k in want if k not in present]
    tied = set(family.tied) | set(family.tied.values())
    unexpected = sorted(k for k in present - set(want) if not k.endswith(IGNORED_BUFFERS) and k not in tied)
    if not missing and not unexpected:
        return []
    model_type = config.get("model_type")
    parts = []
    if missing:
        parts.append(
            f"lack {len(missing)} of the {len(want)} tensors config.json ({model_type}) gives the model "
            f"({', '.join(missing[:most])}{f' and {len(missing) - most} more' if len(missing) > most else ''})"
        )
    if unexpected:
        parts.append(
            f"hold {len(unexpected)} tensors a {model_type} model has no place for "
            f"({', '.join(unexpected[:most])}{f' and {len(unexpected) - most} more' if len(unexpected) > most else ''})"
        )
    like = [f for f in looks_like(held) if f != model_type]
    guess = (
        f"; their decoder layers are those of a {' or '.join(like)} model (model_type {like[0]!r})"
        if like and missing
        else ""
    )
    only_head = missing == [k for k in family.tied if k in want] and not unexpected
    fix = (
        "set tie_word_embeddings: true in config.json if the model shares its input embedding with the output"
        if only_head
        else "point base_model.uri at the folder whose config.json these weights were saved with, or restore the "
        "weights from the model's source"
    )
    return [
        f"{root}: the weight files {' and '.join(parts)}{guess}; from_pretrained would "
        + ("initialize the missing ones at random and train from there" if missing else "drop the others unread")
        + f": {fix}"
    ]


def folder_refusals(root: Path, config: dict[str, Any]) -> list[str]:
    """What load_from_hf refuses in base/, where a Hub model's index, generation config and weights are
    first read: pre-flight's refusals of a local folder, the same sentences."""
    if text_model_type(config):
        return [text_config_refusal(str(root), config)]
    names = {p.name for p in root.iterdir() if p.is_file()}
    out = [why] if (why := index_problem(root, names)) else []
    gen = read_json(root / "generation_config.json")
    out += eos_problems(str(root), {"config.json": config, "generation_config.json": gen}, config.get("vocab_size"))
    from tasks.core.models.claims import claim_problems, held_weights, weight_dtype_problems, weight_file_bytes

    held = held_weights(root)
    claims = [msg for _, msg in claim_problems(config, held, f"{root}/config.json", weight_file_bytes(root))]
    out += claims + weight_dtype_problems(held, root)
    return out if claims else out + weight_shape_problems(root, config)  # the table only within what the files hold


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a broken file is named by the model-files check
    return data if isinstance(data, dict) else None
