"""Every run config in examples/ passes pre-flight as shipped, on the machine it says it needs.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/test_examples.py

Cheap: pre-flight only, no launch. An example states what this machine lacks in its first lines
(`# needs: gpus, slurm, hub, s3`), and the test answers exactly that at the seam pre-flight reads it
through, as tests/test_docs.py does for the documented YAML blocks: `gpus` the `Machine` facts (8
GPUs of 80 GB a node), `slurm` the Slurm backend's `preflight` row, `hub` the Hub's answer for the
repo (its published config.json and file list: what pre-flight reads of a Hub model), `s3` the
data URIs read from the sample files of the same kind. The run root is always a temporary folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tasks.core.launch.torchrun import PREFLIGHTS
from tasks.core.preflight import model_info
from tasks.core.preflight.checks import load_for_check, preflight_report
from tasks.core.preflight.model_info import ModelInfo
from tests.test_docs import CPU_NODE, DEMO_MODEL, GPU_NODE, needs

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# Every kind of run a newcomer copies from: a test fails when one goes missing.
KINDS = {
    "the demo": "tiny-cpu.yaml",
    "a real small model on CPU, one rank": "smollm2-cpu.yaml",
    "a real small model on CPU, two ranks": "smollm2-cpu-2ranks.yaml",
    "LoRA": "lora.yaml",
    "DPO after SFT": "tiny-cpu-dpo.yaml",
    "DPO after SFT on a real small model": "smollm2-cpu-dpo.yaml",
    "long context": "long-context.yaml",
    "a mixture with replay": "tiny-cpu-mixture.yaml",
    "an 8B multi-GPU layout": "llama3-8b-8gpu.yaml",
    "Slurm, two nodes": "llama3-8b-slurm-2nodes.yaml",
}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# What the Hub answers for the repos the examples name: config.json's dimensions as published.
HUB = {
    "HuggingFaceTB/SmolLM2-135M": dict(
        config={
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "torch_dtype": "bfloat16",
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "tie_word_embeddings": True,
            "max_position_embeddings": 8192,
            "rope_theta": 100000,
        },
        tokenizer_config={"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE},
    ),
    "meta-llama/Meta-Llama-3-8B": dict(
        config={
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "torch_dtype": "bfloat16",
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
        tokenizer_config={"eos_token": "<|end_of_text|>", "chat_template": CHAT_TEMPLATE},
    ),
}
SAMPLES = {"text_field": "data/sample/cpt.jsonl", "messages_field": "data/sample/sft.jsonl"}


def _hub(repo: str, revision: str) -> ModelInfo:
    answer = HUB[repo]
    files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    return ModelInfo(
        source="hub",
        where=f"{repo}@{revision}",
        config=answer["config"],
        files=files,
        tokenizer_config=answer["tokenizer_config"],
    )


def _cluster_answers(launch, where, tp_pp=1):
    return []


def _local_data(data: dict) -> dict:
    """An s3:// data URI read from the sample file of its kind (text or chat)."""
    kind = "messages_field" if "messages_field" in data else "text_field"
    out = {**data}
    if str(out.get("uri", "")).startswith("s3://"):
        out["uri"] = str(REPO / SAMPLES[kind])
    return out


def test_examples_cover_every_kind_of_run():
    names = {p.name for p in EXAMPLES}
    missing = {kind: name for kind, name in KINDS.items() if name not in names}
    assert not missing, f"examples/ lacks {missing}"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_says_how_to_run_it(path):
    """Its first lines say what it is and give the command that runs it, naming this file."""
    head = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert head and not head[0].startswith("# needs"), f"{path.name}: start with a line on what the run is"
    assert any(f"cpt-to-sft run --config examples/{path.name}" in line for line in head), (
        f"{path.name}: give the command that runs it, `cpt-to-sft run --config examples/{path.name}`"
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_passes_preflight(path, tiny_model_dir, tmp_path, monkeypatch):
    text = path.read_text()
    want = needs(text)
    assert want <= {"gpus", "slurm", "hub", "s3"}, f"{path.name}: unknown needs {want}"
    raw = yaml.safe_load(text)
    uri = raw["base_model"]["uri"]
    if uri == DEMO_MODEL:
        raw["base_model"]["uri"] = str(tiny_model_dir)
    else:
        assert "hub" in want and uri in HUB, f"{path.name}: a Hub model the test knows, or the demo's"
        monkeypatch.setattr(model_info, "_read_hub", _hub)
    mentions_s3 = bool(re.search(r"\bs3://", yaml.safe_dump({k: raw[k] for k in ("cpt", "sft")})))
    assert mentions_s3 == ("s3" in want), f"{path.name}: `# needs: s3` exactly when its data is on S3"
    for phase in ("cpt", "sft"):
        raw[phase]["data"] = _local_data(raw[phase]["data"])
        heldout = (raw[phase].get("eval") or {}).get("heldout_uri", "")
        if heldout.startswith("s3://"):  # a held-out file of its own: records the training data lacks
            kind = "text_field" if phase == "cpt" else "messages_field"
            lines = (REPO / SAMPLES[kind]).read_text().splitlines()
            (tmp_path / "heldout.jsonl").write_text("\n".join(lines[-20:]) + "\n")
            (tmp_path / "train.jsonl").write_text("\n".join(lines[:-20]) + "\n")
            raw[phase]["data"]["uri"] = str(tmp_path / "train.jsonl")
            raw[phase]["eval"]["heldout_uri"] = str(tmp_path / "heldout.jsonl")
    if "slurm" in want:
        monkeypatch.setitem(PREFLIGHTS, "slurm", _cluster_answers)
    raw["run_root"] = str(tmp_path / "run")
    config = tmp_path / path.name
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    report = preflight_report(
        load_for_check(config), machine=GPU_NODE if "gpus" in want else CPU_NODE, token_present=True
    )
    assert report.ok, f"examples/{path.name}:\n{report.text()}"


def test_no_file_points_at_the_old_config_folder():
    """Run configs moved from the configs folder under deployments/ to examples/: a path to it (a
    docstring's command, a test's fixture, a page) is refused, so a branch written before the move
    cannot bring one back."""
    old = "deployments/" + "configs"
    skip = {".venv", ".git", "build", "runs", "node_modules", ".ruff_cache", ".pytest_cache"}
    files = [
        p
        for p in REPO.rglob("*")
        if p.is_file()
        and not skip & set(p.relative_to(REPO).parts)
        and (p.suffix in (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cfg") or p.name == "Makefile")
    ]
    stale = [str(p.relative_to(REPO)) for p in files if old in p.read_text(errors="replace")]
    joined = '"deployments" / ' + '"configs"'  # the same path built with pathlib's /
    stale += [str(p.relative_to(REPO)) for p in files if joined in p.read_text(errors="replace")]
    assert not stale, f"these name {old}/, whose configs are now in examples/: {sorted(set(stale))}"


@pytest.mark.parametrize(("tp", "nproc", "refused"), [(2, 2, "num_attention_heads"), (3, 3, "")], ids=["tp2", "tp3"])
def test_smollm2s_nine_heads_take_tp3_not_tp2(tp, nproc, refused, tmp_path, monkeypatch):
    """What smollm2-cpu-2ranks.yaml and docs/examples.md say of tp: SmolLM2-135M's 9 heads and 3 KV heads refuse
    tp=2 before launch, naming the field; hybrid_parallel tp=3 on 3 ranks passes pre-flight (ColossalAI's Llama
    policy; the derived one trains its shape at tp=3 to the same losses: shardformer_policies.py --smollm2)."""
    raw = yaml.safe_load((REPO / "examples/smollm2-cpu-2ranks.yaml").read_text())
    monkeypatch.setattr(model_info, "_read_hub", _hub)
    raw["cpt"]["plugin"] = {"name": "hybrid_parallel", "tp_size": tp, "precision": "fp32"}
    raw["cpt"]["launch"] = {"nproc_per_node": nproc}
    raw["cpt"]["data"]["uri"] = str(REPO / SAMPLES["text_field"])
    raw["sft"]["data"]["uri"] = str(REPO / SAMPLES["messages_field"])
    raw["run_root"] = str(tmp_path / "run")
    config = tmp_path / "smollm2-tp.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    report = preflight_report(load_for_check(config), machine=CPU_NODE, token_present=True)
    if refused:
        assert [f for f, _ in report.problems] == ["cpt.plugin.tp_size"], report.text()
        assert refused in report.problems[0][1] and "9" in report.problems[0][1], report.text()
    else:
        assert report.ok, report.text()
        assert "cpt layout: hybrid_parallel tp=3, divides 9 heads / 3 KV heads" in report.text(), report.text()
        # the estimate counts what tp=3 splits: the vocabulary-parallel (tied) embedding and every projection
        assert "cpt memory per rank (estimate, 44.9M of 134.5M parameters)" in report.text(), report.text()
