"""The `cpt-to-sft` console command: overrides, schema, verify, and a wheel installed in a fresh venv.

python -m pytest -q tests/test_cli.py                    # unit tier
python -m pytest -q -m integration tests/test_cli.py     # + build the wheel, install, run it
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

from flows.cli import main, parse_sets, resolved_config, schema
from tasks.core.run.manifest import write_manifest
from tests.conftest import REPO

TINY = str(REPO / "examples" / "tiny-cpu.yaml")


def test_sets_are_yaml_and_applied_in_order(tmp_path):
    sets = parse_sets(["cpt.lr=0.1", "hub=null", "cpt.max_steps=3", "cpt.lr=2.0e-4", "name=x y"])
    assert sets == {"hub": None, "cpt.max_steps": 3, "cpt.lr": 2e-4, "name": "x y"} and list(sets)[-2:] == [
        "cpt.lr",
        "name",
    ]
    # YAML 1.1 reads `1e-4` as a string, in a --set as in the file; the model coerces it alike.
    cfg = resolved_config(
        TINY,
        ["cpt.max_steps=3", "sft.plugin.name=torch_ddp", "sft.plugin.zero_stage=0", "cpt.max_steps=5", "cpt.lr=1e-4"],
    )
    assert cfg.cpt.max_steps == 5 and cfg.sft.plugin.name == "torch_ddp" and cfg.cpt.lr == 1e-4


@pytest.mark.parametrize(
    "item, field",
    [
        ("cpt.max_stepz=3", "cpt.max_stepz"),
        ("cpt.lr=fast", "cpt.lr"),
        # a static rule, the same as in the YAML: in pre-flight's report, with the model's rules beside it
        ("sft.plugin.tp_size=2", "sft.plugin.tp_size"),
        ("cpt.max_steps", "--set cpt.max_steps"),
    ],
)
def test_wrong_override_names_the_field(item, field, capsys):
    assert main(["check", "--config", TINY, "--set", item]) == 1
    said = capsys.readouterr()
    assert f"- {field}:" in said.out + said.err


def test_schema_is_valid_json_schema_and_accepts_the_shipped_configs(capsys):
    from jsonschema import Draft202012Validator

    assert main(["schema"]) == 0
    sch = json.loads(capsys.readouterr().out)
    Draft202012Validator.check_schema(sch)
    validator = Draft202012Validator(sch)
    for path in (REPO / "examples").glob("*.yaml"):
        assert not list(validator.iter_errors(yaml.safe_load(path.read_text()))), path
    assert list(validator.iter_errors({"name": "x"}))  # run_root, base_model, cpt, sft missing
    assert sch == schema()


def _artifact(root: Path) -> Path:
    art = root / "cpt" / "step-000001"
    (art / "model").mkdir(parents=True)
    (art / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    (art / "train_state.json").write_text('{"step": 1}')
    write_manifest(art, kind="test")
    return art


def test_verify_flags_a_flipped_byte_naming_the_file(tmp_path, capsys):
    art = _artifact(tmp_path / "run")
    assert main(["verify", str(tmp_path / "run")]) == 0
    assert "1 of 1 artifacts verify" in capsys.readouterr().out
    f = art / "model" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[100] ^= 0x01
    f.write_bytes(bytes(data))
    assert main(["verify", str(art)]) == 1
    out = capsys.readouterr().out
    assert "model/model.safetensors fails its sha256 check" in out and "0 of 1" in out


def test_relative_paths_resolve_against_the_checkout_or_cpt_to_sft_home(monkeypatch, tmp_path):
    from tasks.core.config.paths import project_root, resolve_local

    monkeypatch.delenv("CPT_TO_SFT_HOME", raising=False)
    assert project_root() == REPO
    monkeypatch.setenv("CPT_TO_SFT_HOME", str(tmp_path))
    assert resolve_local("runs/x") == str(tmp_path / "runs" / "x")


@pytest.mark.integration
def test_wheel_in_a_fresh_venv(tmp_path):
    """`pip wheel .` then install it (no deps) into a new venv that sees the shared site-packages
    through a plain .pth line (torch & co. are not reinstalled; the shared editable install's own
    finder is not loaded), and run the command from outside any checkout."""
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("cpt_to_sft-*.whl")
    # the tests' and benchmarks' shared code (support/) is read from a checkout, never shipped
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("support/")]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vsite = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (vsite / "shared-stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # No PYTHONPATH (conftest points it at the checkout for child processes): pip would find the
    # checkout's cpt_to_sft.egg-info there, call the wheel's version installed and skip it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CPT_TO_SFT_HOME")}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        check=True,
        timeout=300,
        env=env,
    )
    exe = venv / "bin" / "cpt-to-sft"
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(
            [str(exe), *args], check=False, cwd=work, env=env, capture_output=True, text=True, timeout=300
        )
        assert (r.returncode == 0) == ok, (args, r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        return r

    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            (
                "import tasks, flows; print(tasks.__file__); from tasks.core.config.paths import project_root; "
                "print(project_root())"
            ),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert where[0].startswith(str(vsite)) and where[1] == str(work)  # installed copy; relative paths from the cwd
    assert "cpt-to-sft 0.1.0" in run("--version").stdout
    assert "verify" in run("--help").stdout
    for cmd in ("run", "check", "break-lease", "convert", "verify", "eval", "schema"):
        assert "usage:" in run(cmd, "--help").stdout, cmd
    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(json.loads(run("schema").stdout))
    art = _artifact(work / "run")
    run("verify", "run")  # relative to the cwd
    f = art / "train_state.json"
    f.write_text('{"step": 2}')
    r = run("verify", "run", ok=False)
    assert "train_state.json fails its sha256 check" in r.stdout


def test_verify_recomputes_the_fingerprint_of_an_hf_artifact(tmp_path, tiny_model_dir, capsys):
    """An HF folder whose weights were swapped and its manifest rewritten passes sha256, but its
    logits no longer match the recorded fingerprint."""
    from safetensors.torch import load_file, save_file

    from tasks.core.models.fingerprint import hf_dir_logits, save_fingerprint

    art = tmp_path / "run" / "base"
    shutil.copytree(tiny_model_dir, art)
    fingerprint = save_fingerprint(hf_dir_logits(art), art, "fp32")
    write_manifest(art, kind="hf-model", fingerprint=fingerprint)
    assert main(["verify", str(art)]) == 0
    assert "fingerprint recomputed (relative diff 0 <= 1e-05)" in capsys.readouterr().out
    (weights,) = art.glob("*.safetensors")
    tensors = load_file(str(weights))
    name = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, str(weights), metadata={"format": "pt"})
    write_manifest(art, kind="hf-model", fingerprint=fingerprint)
    assert main(["verify", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    assert "recomputed logits differ from its fingerprint" in out and str(art) in out
    assert main(["verify", "--no-fingerprint", str(art)]) == 0


def test_eval_of_one_folder_and_schema_into_a_closed_pipe(tiny_model_dir, capsys):
    assert (
        main(
            [
                "eval",
                "cpt",
                "--model",
                str(tiny_model_dir),
                "--data",
                str(REPO / "data" / "sample" / "cpt.jsonl"),
                "--seq-len",
                "32",
            ]
        )
        == 0
    )
    m = json.loads(capsys.readouterr().out)
    assert m["model"] == str(tiny_model_dir) and m["perplexity"] > 1 and m["tokens"] > 0
    r = subprocess.run(
        f"{sys.executable} -m flows.cli schema | head -n 1",
        shell=True,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert r.stdout == "{\n" and r.stderr == ""


def test_config_commands_leave_no_temp_files(tmp_path, monkeypatch, capsys):
    """The config is read once per command, into directories that are gone when it returns."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert main(["break-lease", "--config", TINY, "--run-root", str(tmp_path / "run")]) == 0
    assert main(["check", "--config", TINY, "--set", "cpt.lr=fast"]) == 1
    assert "none held" in capsys.readouterr().out and list(scratch.iterdir()) == []


def test_help_lists_every_command_in_one_line_with_an_example_that_parses(capsys):
    """`cpt-to-sft --help`: each subcommand once, one line, and an example; each example parses
    (the config commands by this parser, the delegated ones' options are in their own --help);
    `cpt-to-sft run --help` names the config file, the --set form and --stop-after."""
    from flows.cli import COMMANDS, DELEGATED, FLOW_ALIAS, build_parser

    parser = build_parser()
    with pytest.raises(SystemExit) as out:
        parser.parse_args(["--help"])
    assert out.value.code == 0
    text = capsys.readouterr().out
    listed = [
        line.split()[0] for line in text.split("commands (")[1].split("examples:")[0].splitlines()[1:] if line.strip()
    ]
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    # unlisted: the command `python -m flows.cpt_to_sft` parses its arguments as
    assert listed == list(COMMANDS) and set(listed) == set(choices) - {FLOW_ALIAS}, (listed, sorted(choices))
    examples = [line.strip() for line in text.split("examples:")[1].splitlines() if line.strip()]
    assert [e.split()[1] for e in examples] == list(COMMANDS)
    assert "usage: cpt-to-sft [-h] [--version] COMMAND ..." in text
    for example in examples:
        argv = shlex.split(example.split(">")[0])[1:]
        if argv[0] in DELEGATED:
            with pytest.raises(SystemExit) as out:
                main([argv[0], "--help"])
            assert out.value.code == 0
            own = capsys.readouterr().out
            assert all(opt in own for opt in argv if opt.startswith("--")), (example, own)
        else:
            assert parser.parse_args(argv).cmd == argv[0]
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--help"])
    run_help = capsys.readouterr().out
    for said in (
        "--config FILE",
        "YAML",
        "examples/tiny-cpu.yaml",
        "--set KEY.PATH=VALUE",
        "--set cpt.lr=1e-4",
        "--stop-after STAGE",
        "push_to_hub",
        "exit status",
    ):
        assert said in run_help, said
