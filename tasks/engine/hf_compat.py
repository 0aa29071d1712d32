"""ColossalAI 0.5.0's shardformer forwards on a transformers newer than the 4.51.3 they were written for.

    python -c "from tasks.engine import hf_compat; print(hf_compat.apply()); print(hf_compat.apply())"

Applied once per process, at engine start, on every device (`tasks.engine.__main__`, right after the first
import of ColossalAI), before any shardformer policy is imported. Idempotent: a second `apply()` returns [].

ColossalAI's Llama, Mistral, Qwen2, Cohere, Mixtral and GPT-2 policies replace the model's forward (or its
attention's) with their own (`colossalai/shardformer/modeling/{llama,mistral,qwen2,command,mixtral,gpt2}.py`):
Llama's whenever it shards (tp too), the others' under pipeline or sequence parallelism or flash attention;
Llama's and Cohere's modules fail at import, and ColossalAI's OPT policy imports a class 4.52 removed
(`policies/opt.py`). That code was written against transformers 4.51's modeling code, and later releases break
it (docs/versions.md, release by release):

- 4.52 moved `StaticCache` out of `modeling_llama` (ImportError when the Llama policy is imported);
- 4.53 removed `LlamaModel._update_causal_mask` / `MistralModel._update_causal_mask` (masks now come from
  `transformers.masking_utils`: `create_causal_mask`, or `create_sliding_window_causal_mask` where the config
  has a sliding window, as the models themselves choose);
- 4.54 made a decoder layer return the hidden-state tensor (`layer_outputs[0]` took the first sequence of the
  batch) and dropped its `output_attentions` parameter, so the positional calls ColossalAI makes (checkpointed
  layers, every Qwen2 and Mixtral layer) land on the wrong parameters; GPT-2's block passes the attention it
  replaces `past_key_values` and unpacks two values from it;
- 4.54 also made each decoder layer a `GradientCheckpointingLayer` that checkpoints itself when gradient
  checkpointing is on: ColossalAI's forwards decide which layers to checkpoint (`gradient_checkpoint_config`),
  so the layers are called through `torch.nn.Module.__call__`, which runs their hooks and forward without the
  layer's own, second checkpoint (the layer count ColossalAI chose, as on 4.51.3).

Rather than edit site-packages (a fresh install would not have the edit), each of those modules is built from its
installed source with exact text replacements (`_EDITS`) when it is first imported (an import hook `apply()`
installs: a rank imports only the modules its model's policy needs; all seven cost 0.1 CPU-s here): the file must
be ColossalAI 0.5.0's (its sha256), every replacement must match exactly as often as written; a module imported
before `apply()` is rebuilt at once and rebound in every ColossalAI module that bound its names. On any
transformers or ColossalAI the replacements were not measured on, `apply()` refuses with `UnsupportedStack` naming
what is installed and what runs: the project runs transformers 4.57.x (pyproject.toml pins 4.57.6), and 4.51.3 is
refused too (the project passes 4.56's `dtype` keyword, which 4.51.3 hands to the model's constructor).
`apply()` also keeps off the console the deprecation warning 4.56+ logs on every rank when ColossalAI's
`save_config_file` sets `config.torch_dtype` (the one caller left that uses the old name).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any

_MARK = "_cpt_to_sft_hf_compat"

COLOSSALAI = "0.5.0"
WRITTEN_FOR = "4.51.3"  # the transformers ColossalAI 0.5.0 pins and its forwards were written for
PATCHED = ("4.57",)  # the transformers series the project runs, the replacements measured on it (docs/versions.md)


class UnsupportedStack(ValueError):
    """The installed transformers or ColossalAI is one the replacements were not measured on (a ValueError: the
    engine reports it as one line, no traceback)."""


def causal_mask(model, attention_mask, hidden_states, cache_position, past_key_values, position_ids):
    """The 4-D mask (or None: sdpa's own causal path) the model's own forward builds on transformers >= 4.53."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_sliding_window_causal_mask if getattr(model.config, "sliding_window", None) else create_causal_mask
    return make(
        config=model.config,
        input_embeds=hidden_states,
        attention_mask=attention_mask,
        cache_position=cache_position,
        past_key_values=past_key_values,
        position_ids=position_ids,
    )


_LAYER_OUT = ("hidden_states = layer_outputs[0]", "hidden_states = _cpt_to_sft_hidden(layer_outputs)")
# 4.56 renamed a decoder layer's `past_key_value` to `past_key_values` (the old name warns on every forward)
_CACHE_KW = ("past_key_value=past_key_values,", "past_key_values=past_key_values,")

_QWEN2_POSITIONAL = """                    decoder_layer.__call__,
                    hidden_states,
                    attention_mask,
                    position_ids,
                    past_key_values,
                    output_attentions,
                    use_cache,
                    cache_position,
                    position_embeddings,
                )"""
_QWEN2_KEYWORDS = """                    _cpt_to_sft_call(
                        decoder_layer,
                        attention_mask=attention_mask,
                        position_ids=position_ids,
                        past_key_values=past_key_values,
                        use_cache=use_cache,
                        cache_position=cache_position,
                        position_embeddings=position_embeddings,
                    ),
                    hidden_states,
                )"""
_QWEN2_DIRECT = """                layer_outputs = decoder_layer(
                    hidden_states,
                    attention_mask,
                    position_ids,
                    past_key_values,
                    output_attentions,
                    use_cache,
                    cache_position,
                    position_embeddings,
                )"""
_QWEN2_DIRECT_KEYWORDS = """                layer_outputs = torch.nn.Module.__call__(
                    decoder_layer,
                    hidden_states,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    past_key_values=past_key_values,
                    use_cache=use_cache,
                    cache_position=cache_position,
                    position_embeddings=position_embeddings,
                )"""

# A 4.54+ Mixtral layer returns its hidden states only (router logits go to output recorders ColossalAI's forwards
# do not install): refused rather than the hidden states taken for router logits.
_ROUTER_LOGITS = """            if output_router_logits:
                all_router_logits += (layer_outputs[-1],)
"""
_ROUTER_LOGITS_REFUSED = """            if output_router_logits:
                raise RuntimeError(
                    "output_router_logits under ColossalAI's Mixtral forwards needs transformers 4.51.3: set "
                    "output_router_logits: false in config.json, or install transformers==4.51.3"
                )
"""

# module -> (sha256 of ColossalAI 0.5.0's file, [(old, new, how many times old occurs)])
_EDITS: dict[str, tuple[str, list[tuple[str, str, int]]]] = {
    "colossalai.shardformer.modeling.llama": (
        "1537050ee395fe0e769008862cce771196d96fb9c5680ce0ce3b15caf96818f1",
        [
            (
                "from transformers.cache_utils import Cache, DynamicCache\n",
                "from transformers.cache_utils import Cache, DynamicCache, StaticCache\n",
                1,
            ),
            ("    LlamaModel,\n    StaticCache,\n", "    LlamaModel,\n", 1),
            (
                """attn_kwargs: torch.Tensor = self._update_causal_mask(
                attention_mask, hidden_states, cache_position, past_key_values
            )""",
                """attn_kwargs: torch.Tensor = _cpt_to_sft_causal_mask(
                self, attention_mask, hidden_states, cache_position, past_key_values, position_ids
            )""",
                1,
            ),
            (
                """                    decoder_layer.__call__,
                    hidden_states,
                    attn_kwargs,
                    position_ids,
                    past_key_values,
                    output_attentions,
                    use_cache,
                    cache_position,
                    position_embeddings,
                )""",
                """                    _cpt_to_sft_call(
                        decoder_layer,
                        attention_mask=attn_kwargs,
                        position_ids=position_ids,
                        past_key_values=past_key_values,
                        use_cache=use_cache,
                        cache_position=cache_position,
                        position_embeddings=position_embeddings,
                    ),
                    hidden_states,
                )""",
                1,
            ),
            (
                "                layer_outputs = decoder_layer(\n",
                "                layer_outputs = _cpt_to_sft_call(decoder_layer)(\n",
                1,
            ),
            (*_CACHE_KW, 1),
            (*_LAYER_OUT, 1),
        ],
    ),
    "colossalai.shardformer.modeling.mistral": (
        "51ee549b06700102cd0d828fed2833552ba3901892ce8e2fc4203377897c7363",
        [
            (
                """attention_mask = self._update_causal_mask(
                attention_mask, hidden_states, cache_position, past_key_values, output_attentions
            )""",
                """attention_mask = _cpt_to_sft_causal_mask(
                self, attention_mask, hidden_states, cache_position, past_key_values, position_ids
            )""",
                1,
            ),
            (
                "                    decoder_layer.__call__,\n",
                "                    _cpt_to_sft_call(decoder_layer),\n",
                1,
            ),
            (
                "                layer_outputs = decoder_layer(\n",
                "                layer_outputs = _cpt_to_sft_call(decoder_layer)(\n",
                1,
            ),
            (
                "            layer_outputs = decoder_layer(\n",
                "            layer_outputs = _cpt_to_sft_call(decoder_layer)(\n",
                1,
            ),
            (*_CACHE_KW, 3),
            (*_LAYER_OUT, 2),
        ],
    ),
    "colossalai.shardformer.modeling.command": (  # Cohere's policy: Llama's forward, its StaticCache import too
        "760931e85f0103a4259e3dd8fe9d0c7c8120ffb2780ea71db853535130e19e20",
        [
            ("    CohereModel,\n    StaticCache,\n", "    CohereModel,\n", 1),
            (
                "from transformers.cache_utils import Cache, DynamicCache\n",
                "from transformers.cache_utils import Cache, DynamicCache, StaticCache\n",
                1,
            ),
            (
                "self._update_causal_mask(attention_mask, hidden_states, cache_position, past_key_values)",
                "_cpt_to_sft_causal_mask(self, attention_mask, hidden_states, cache_position, past_key_values, position_ids)",
                1,
            ),
            (
                "self._update_causal_mask(attention_mask, inputs_embeds, cache_position, past_key_values)",
                "_cpt_to_sft_causal_mask(self, attention_mask, inputs_embeds, cache_position, past_key_values, position_ids)",
                1,
            ),
            (_QWEN2_POSITIONAL, _QWEN2_KEYWORDS, 2),
            (
                "                layer_outputs = decoder_layer(\n",
                "                layer_outputs = _cpt_to_sft_call(decoder_layer)(\n",
                2,
            ),
            (*_CACHE_KW, 2),
            (*_LAYER_OUT, 2),
        ],
    ),
    "colossalai.shardformer.modeling.mixtral": (  # its pipeline forward: positional layer calls
        "017e0d52ff5e6e1a43da41006eb1e8a6a4d05baba384cdddc989c4459eb5a83d",
        [
            (
                """                    create_custom_forward(decoder_layer),
                    hidden_states,
                    attention_mask,
                    position_ids,
                    None,
                    output_attentions,
                    output_router_logits,
                    use_cache,
                    cache_position,
                    position_embeddings,
                )""",
                """                    _cpt_to_sft_call(
                        decoder_layer,
                        attention_mask=attention_mask,
                        position_ids=position_ids,
                        use_cache=use_cache,
                        cache_position=cache_position,
                        position_embeddings=position_embeddings,
                    ),
                    hidden_states,
                )""",
                1,
            ),
            (
                """                layer_outputs = decoder_layer(
                    hidden_states,
                    attention_mask,
                    position_ids,
                    past_key_value,
                    output_attentions,
                    output_router_logits,
                    use_cache,
                    cache_position,
                    position_embeddings,
                )""",
                """                layer_outputs = torch.nn.Module.__call__(
                    decoder_layer,
                    hidden_states,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    past_key_values=past_key_value,
                    use_cache=use_cache,
                    cache_position=cache_position,
                    position_embeddings=position_embeddings,
                )""",
                1,
            ),
            (  # the flash-attention / sequence-parallel model forward
                """                    decoder_layer.__call__,
                    hidden_states,
                    attention_mask,
                    position_ids,
                    past_key_values,
                    output_attentions,
                    output_router_logits,
                    use_cache,
                    cache_position=cache_position,
                    position_embeddings=position_embeddings,
                )""",
                _QWEN2_KEYWORDS,
                1,
            ),
            (
                "                layer_outputs = decoder_layer(\n",
                "                layer_outputs = _cpt_to_sft_call(decoder_layer)(\n",
                1,
            ),
            (_ROUTER_LOGITS, _ROUTER_LOGITS_REFUSED, 2),
            (*_CACHE_KW, 1),
            (*_LAYER_OUT, 2),
        ],
    ),
    "colossalai.shardformer.modeling.gpt2": (  # its attention forward and its blocks' calls
        "64a32b39c345293b255ebba0fb73325d52bff08178acc1d4186411abc3f1fc57",
        [
            (  # 4.57's GPT2Block passes past_key_values and cache_position to the attention it replaces
                """        output_attentions: Optional[bool] = False,
    ) -> Tuple[Union[torch.Tensor, Tuple[torch.Tensor]], ...]:""",
                """        output_attentions: Optional[bool] = False,
        **kwargs,
    ) -> Tuple[Union[torch.Tensor, Tuple[torch.Tensor]], ...]:""",
                1,
            ),
            (
                """                    block.__call__,
                    hidden_states,
                    None,
                    attn_kwargs,
                    head_mask[i],
                    encoder_hidden_states,
                    encoder_attention_mask,
                    use_cache,
                    output_attentions,
                )""",
                """                    _cpt_to_sft_call(
                        block,
                        attention_mask=attn_kwargs,
                        head_mask=head_mask[i],
                        encoder_hidden_states=encoder_hidden_states,
                        encoder_attention_mask=encoder_attention_mask,
                        use_cache=use_cache,
                        output_attentions=output_attentions,
                    ),
                    hidden_states,
                )""",
                1,
            ),
            ("                outputs = block(\n", "                outputs = _cpt_to_sft_call(block)(\n", 1),
            # 4.54+'s block unpacks (output, weights); the cache is an object it updates (off in training here)
            ("        outputs = (attn_output, present, None)\n", "        outputs = (attn_output, None)\n", 1),
        ],
    ),
    "colossalai.shardformer.policies.opt": (  # 4.52 folded OptFlashAttention2 into OPTAttention
        "b68681e326a990a687ce8553f70e25a1114c313db82fe7c851cce876f6c393ef",
        [
            (
                "import OPTAttention, OPTDecoder, OPTDecoderLayer, OptFlashAttention2\n",
                "import OPTAttention, OPTDecoder, OPTDecoderLayer\n",
                1,
            ),
            (
                '            "flash_attention_2": OptFlashAttention2,\n',
                '            "flash_attention_2": OPTAttention,\n',
                1,
            ),
        ],
    ),
    "colossalai.shardformer.modeling.qwen2": (
        "e4f022c0c970e86c000cd839b39d111a00d91a3bc3cd194d96c5086a7817e308",
        [
            (_QWEN2_POSITIONAL, _QWEN2_KEYWORDS, 2),
            (_QWEN2_DIRECT, _QWEN2_DIRECT_KEYWORDS, 2),
            (*_LAYER_OUT, 2),
        ],
    ),
}


def _hidden(layer_outputs):
    import torch

    return layer_outputs if isinstance(layer_outputs, torch.Tensor) else layer_outputs[0]


def _call(layer, **kwargs):
    """The layer's forward (hooks included) without its own checkpoint: ColossalAI's forward chose."""
    import functools

    import torch

    return functools.partial(torch.nn.Module.__call__, layer, **kwargs)


def check() -> bool:
    """True on the stack the project runs (ColossalAI 0.5.0, transformers 4.57.x), whose forwards need the
    replacements; raises UnsupportedStack on any other transformers or ColossalAI. transformers 4.51.3, which
    ColossalAI 0.5.0 was written for, is refused too: the project calls transformers with the `dtype` keyword
    4.56 introduced, which 4.51.3 hands on to the model's constructor (a TypeError at the first build)."""
    import colossalai
    import transformers

    tf, cai = transformers.__version__, colossalai.__version__
    runs = f"the project runs on ColossalAI {COLOSSALAI} with transformers {', '.join(p + '.x' for p in PATCHED)}"
    if cai != COLOSSALAI:
        raise UnsupportedStack(
            f"colossalai {cai} is installed: {runs} (docs/versions.md); reinstall with `bash scripts/install.sh`"
        )
    if ".".join(tf.split(".")[:2]) in PATCHED:
        return True
    raise UnsupportedStack(
        f"transformers {tf} is installed: {runs} (pyproject.toml pins it), whose shardformer forwards are patched "
        "for it (tasks/engine/hf_compat.py, docs/versions.md); reinstall with `bash scripts/install.sh`"
    )


def edited_source(name: str) -> tuple[str, str]:
    """(path, source) of ColossalAI's module `name` with its replacements made; reads the file only (no import).
    Raises UnsupportedStack when the file is not ColossalAI 0.5.0's or a replacement does not match."""
    digest, edits = _EDITS[name]
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise UnsupportedStack(f"{name} is not installed: ColossalAI {COLOSSALAI} ships it")
    raw = Path(spec.origin).read_bytes()
    if hashlib.sha256(raw).hexdigest() != digest:
        raise UnsupportedStack(
            f"{spec.origin} is not ColossalAI {COLOSSALAI}'s (sha256 differs): the replacements in "
            "tasks/engine/hf_compat.py were written for that file; reinstall with `bash scripts/install.sh`"
        )
    source = raw.decode()
    for old, new, times in edits:
        found = source.count(old)
        if found != times:  # a digest match makes this unreachable; kept so an edit can never half-apply
            raise UnsupportedStack(f"{spec.origin}: expected {times} of {old.strip()[:60]!r}, found {found}")
        source = source.replace(old, new)
    return spec.origin, source


def _execute(module: types.ModuleType) -> None:
    origin, source = edited_source(module.__name__)
    module.__dict__.update(_cpt_to_sft_causal_mask=causal_mask, _cpt_to_sft_hidden=_hidden, _cpt_to_sft_call=_call)
    setattr(module, _MARK, True)
    # ColossalAI's own installed file (its sha256 checked above) with the edits above: no input of a run
    exec(compile(source, origin, "exec"), module.__dict__)  # noqa: S102


class _OnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Builds each listed module from its edited source when it is first imported (by the policy that needs it),
    so a rank imports none of them that its model's policy does not."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _EDITS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None:
            spec.loader = self
        return spec

    def create_module(self, spec: Any) -> None:
        return None  # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        _execute(module)


_FINDER = _OnImport()

_DTYPE_NOTICE = "`torch_dtype` is deprecated"


class _ColossalAIDtypeNotice(logging.Filter):
    """ColossalAI 0.5.0's `save_config_file` (every sharded save, every plugin) sets `model.config.torch_dtype`, which
    4.56+ answers with a deprecation warning on every rank; the value lands in `config.dtype` all the same. The
    project itself passes `dtype`, so that warning can only come from ColossalAI here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _DTYPE_NOTICE not in record.getMessage()


def _quiet_colossalai_dtype_notice() -> None:
    log = logging.getLogger("transformers.configuration_utils")
    if not any(isinstance(f, _ColossalAIDtypeNotice) for f in log.filters):
        log.addFilter(_ColossalAIDtypeNotice())


def apply() -> list[str]:
    """Fit ColossalAI's shardformer code to the installed transformers: each module in `_EDITS` is built from its
    edited source when first imported (one imported already is rebuilt now). Returns the modules this call
    took over (empty when already done)."""
    if not check() or _FINDER in sys.meta_path:
        return []
    _quiet_colossalai_dtype_notice()
    sys.meta_path.insert(0, _FINDER)
    for name in _EDITS:
        old = sys.modules.get(name)
        if old is None or getattr(old, _MARK, False):
            continue
        spec = importlib.machinery.PathFinder.find_spec(name, sys.modules[name.rpartition(".")[0]].__path__)
        new = importlib.util.module_from_spec(spec)
        _execute(new)
        sys.modules[name] = new
        parent, _, leaf = name.rpartition(".")
        setattr(sys.modules[parent], leaf, new)
        # a policy imported before apply() bound the broken functions: rebind them
        for mod in list(sys.modules.values()):
            if mod is None or mod is new or not getattr(mod, "__name__", "").startswith("colossalai."):
                continue
            for attr, value in list(vars(mod).items()):
                if getattr(value, "__module__", None) == name and hasattr(new, getattr(value, "__name__", "")):
                    setattr(mod, attr, getattr(new, value.__name__))
    return list(_EDITS)


MODULES = tuple(_EDITS)  # the ColossalAI modules apply() builds from their edited source


def is_applied() -> bool:
    return check() and _FINDER in sys.meta_path
