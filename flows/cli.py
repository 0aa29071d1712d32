"""The `cpt-to-sft` console command (`[project.scripts]`; `pip install .` puts it on PATH).

    cpt-to-sft run --config examples/tiny-cpu.yaml --set cpt.max_steps=4 --set cpt.lr=1e-4
    cpt-to-sft check --config FILE [--set key.path=value ...]     # pre-flight only, launches nothing
    cpt-to-sft run --config FILE --stop-after export                # the stages up to the export only
    cpt-to-sft break-lease --config FILE
    cpt-to-sft convert SRC_DIR DST_DIR [--dtype bf16 ...]           # ColossalAI checkpoint -> HF safetensors
    cpt-to-sft verify PATH                                          # an artifact or a whole run root
    cpt-to-sft eval {cpt,sft} --model DIR --data FILE --seq-len N [--reference DIR]  # held-out metrics
    cpt-to-sft schema                                               # RunConfig's JSON Schema
    cpt-to-sft notifications --webhook-url URL                      # failure notifications (flows/notifications.py)
    cpt-to-sft --version

`--set key.path=value` overrides are applied in the order given, each value parsed as YAML (so
`--set cpt.lr=1e-4` is a float and `--set hub=null` removes the push), and the result is validated
by the same models as the YAML file: a wrong one is an error naming the field. A list item is named
by its index (`--set cpt.elastic.notices.0.grace_s=5`). `run` hands the flow the config file and the
--set items, never a resolved copy: the retry after a preemption reads the file again (docs/spot.md),
the same --set items applied. Without the install,
`python -m flows.cpt_to_sft --config FILE [--check | --break-lease]` is run, check or break-lease
(`flow_main`). Relative paths resolve as in tasks/core/config/paths.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

EXIT_FAILED_GATE = 3  # the run finished and kept its artifacts, but the gate held the push back
EXIT_INTERRUPTED = 130  # the shell's status for a command ended by SIGINT
FLOW_ALIAS = "flow"  # the command `python -m flows.cpt_to_sft` is, left out of the listing


def version() -> str:
    """The installed distribution's version; from a checkout that is not installed, pyproject's."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("cpt-to-sft")
    except PackageNotFoundError:
        import tomllib

        from tasks.core.config.paths import REPO_ROOT

        pyproject = REPO_ROOT / "pyproject.toml"
        if pyproject.is_file():
            return tomllib.loads(pyproject.read_text())["project"]["version"] + " (checkout, not installed)"
        return "unknown"


def parse_sets(items: list[str]) -> dict[str, Any]:
    """['a.b=1', 'c=x'] -> {'a.b': 1, 'c': 'x'}, later ones winning, order kept."""
    from tasks.core.config.overrides import parse_sets as parse

    return parse(items)


def resolved_config(config: str, sets: list[str], run_root: str | None = None, run_name: str | None = None) -> Any:
    """The config (local path or fsspec URI) with the overrides applied, its fields validated; a
    ConfigError names every wrong one. Its fields only: the rules across fields are pre-flight's
    (check's report, the flow's first task), with the model and the device at hand, so a layout
    refused for the model and for seq_len is one answer whose fixes pass both. `run` reads it to
    refuse before a server starts; the flow then reads the user's file itself, and again on a retry."""
    from tasks.core.config.load import parse_fields as parse_config
    from tasks.core.config.load import read_raw_config
    from tasks.core.config.paths import resolve_local
    from tasks.core.storage.fs import fetch_to_local

    overrides = parse_sets(sets)
    overrides.update({k: v for k, v in (("run_root", run_root), ("name", run_name)) if v})
    with tempfile.TemporaryDirectory(prefix="cpt-to-sft-config-") as tmp:  # a remote config's copy, gone once read
        path = fetch_to_local(resolve_local(config), Path(tmp))
        raw = read_raw_config(path, overrides)
    return parse_config(raw, source=f"{config} with --set overrides" if overrides else config)


def _config_args(p: argparse.ArgumentParser, sets: bool = True) -> None:
    p.add_argument(
        "--config",
        required=True,
        metavar="FILE",
        help="the run's YAML config file: local path or fsspec URI (e.g. examples/tiny-cpu.yaml)",
    )
    if sets:
        p.add_argument(
            "--set",
            dest="sets",
            action="append",
            default=[],
            metavar="KEY.PATH=VALUE",
            help="override one config field, e.g. --set cpt.max_steps=100 (value parsed as YAML); repeatable, applied "
            "in order",
        )
    p.add_argument("--run-root", help="override run_root (local path, NFS path or s3://...)")
    p.add_argument("--run-name", help="override the run name")


def add_stop_after(p: argparse.ArgumentParser) -> None:
    from tasks.core.run.stages import STAGE_NAMES

    p.add_argument(
        "--stop-after",
        choices=STAGE_NAMES,
        metavar="STAGE",
        help=f"run the stages up to and including STAGE, record the rest as not-run, exit 0 (one of: {', '.join(STAGE_NAMES)})",
    )


# Subcommands that are whole existing CLIs: their own parser and --help, unchanged.
def _convert(argv: list[str]) -> int:
    from tasks.core.models.convert.__main__ import main as _main

    return _main(argv)


def _eval(argv: list[str]) -> int:
    from tasks.core.evaluation.heldout import main as eval_main

    eval_main(argv)
    return 0


def _notifications(argv: list[str]) -> int:
    from flows.notifications import main as notify_main

    return notify_main(argv)


DELEGATED = {
    "notifications": (
        _notifications,
        "apply the failure-notification automation (deployments/automations.yaml) to the Prefect server",
    ),
    "convert": (_convert, "a ColossalAI checkpoint directory -> HF safetensors (the streaming converter)"),
    "eval": (_eval, "held-out loss/perplexity of an HF model folder on a data file (--reference DIR compares two)"),
}

# `cpt-to-sft --help`: each command in one line, and one example of it (tests/test_cli.py runs every
# example's `--help`, and the config commands' examples with --check-like parsing).
COMMANDS = {
    "run": (
        "run the whole flow, or its stages up to --stop-after",
        "cpt-to-sft run --config examples/tiny-cpu.yaml --set cpt.max_steps=4",
    ),
    "check": (
        "pre-flight only: every problem at once, nothing launched",
        "cpt-to-sft check --config examples/tiny-cpu.yaml",
    ),
    "verify": (
        "verify an artifact or every artifact of a run root",
        "cpt-to-sft verify runs/tiny-demo --no-fingerprint",
    ),
    "break-lease": (
        "remove the run root's lease left by a dead run",
        "cpt-to-sft break-lease --config examples/tiny-cpu.yaml",
    ),
    "convert": (
        "a ColossalAI checkpoint -> HF safetensors",
        "cpt-to-sft convert runs/tiny-demo/sft/step-000030 /tmp/hf --dtype bf16",
    ),
    "eval": (
        "held-out loss/perplexity of an HF model folder",
        "cpt-to-sft eval sft --model runs/tiny-demo/export --data data/sample/sft.jsonl --seq-len 128",
    ),
    "schema": ("print the run config's JSON Schema", "cpt-to-sft schema > run-config.schema.json"),
    "card": ("render the export's model card (export/README.md) again", "cpt-to-sft card runs/tiny-demo"),
    "notifications": (
        "failure notifications on the Prefect server",
        "cpt-to-sft notifications --webhook-url https://hooks.example.com/T0/B0",
    ),
}


_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def recompute_fingerprint(art: Path, manifest: dict[str, Any]) -> str:
    """Re-run the probe batch through an HF-format artifact (plain transformers, its own dtype) and
    compare with its stored fingerprint. Plugin checkpoints (weights under model/) need the plugin
    to load, so only their sha256 is checked."""
    from tasks.core.config.schema import VERIFY_MEMORY_GB
    from tasks.core.errors import ManifestError
    from tasks.core.models.fingerprint import compare_logits, default_rtol, hf_dir_logits, load_fingerprint

    if not manifest.get("fingerprint"):
        return "no fingerprint"
    if not (art / "config.json").is_file():
        return "fingerprint sha256 ok (a plugin checkpoint: logits not recomputed)"
    dtype = str(manifest["fingerprint"].get("dtype", "fp32"))
    rtol = default_rtol(_DTYPE_NAMES.get(dtype, dtype))
    c = compare_logits(hf_dir_logits(art, verify_memory_gb=VERIFY_MEMORY_GB), load_fingerprint(art), rtol)
    if not c["fingerprint_match"]:
        raise ManifestError(
            f"{art}: recomputed logits differ from its fingerprint (relative {c['fingerprint_rel_diff']:.3g} > "
            f"{rtol:g}, "
            f"{c['top1_disagreements_beyond_tolerance']} top-1 flips): the weights do not produce the recorded model"
        )
    return f"fingerprint recomputed (relative diff {c['fingerprint_rel_diff']:.3g} <= {rtol:g})"


def verify(path: str, fingerprints: bool = True) -> int:
    """Every artifact (a directory with manifest.json) at or under `path`: files, sizes, sha256,
    the model-folder rule (no stray `*.safetensors`, no adapter beside merged weights, listed or
    not), and, for HF-format artifacts with a fingerprint, the logits recomputed. One line per
    artifact; 1 if any fails."""
    from tasks.core.errors import ManifestError
    from tasks.core.models.folder import folder_problems
    from tasks.core.run.manifest import MANIFEST, manifest_digest, verify_artifact

    root = Path(path)
    if not root.exists():
        print(f"FAILED: {root}: no such file or directory", file=sys.stderr)
        return 1
    depth = len(Path(MANIFEST).parts)  # the manifest may sit in a subfolder of its artifact
    roots = [root] if (root / MANIFEST).is_file() else sorted(p.parents[depth - 1] for p in root.rglob(MANIFEST))
    if not roots:
        print(f"FAILED: {root}: no manifest.json at or under it: not an artifact or run root", file=sys.stderr)
        return 1
    failed = 0
    for art in roots:
        try:
            m = verify_artifact(art, deep=True)
            strays = folder_problems(art)  # files the manifest does not list are judged too: a loader globs the folder
            if strays:
                raise ManifestError("; ".join(strays))
            fp = (
                recompute_fingerprint(art, m)
                if fingerprints
                else ("fingerprint not recomputed" if m.get("fingerprint") else "no fingerprint")
            )
        except (ManifestError, ValueError, OSError) as exc:
            failed += 1
            print(f"FAILED: {exc}")
            continue
        print(f"ok: {art} kind={m.get('kind')} files={len(m['files'])} {fp} digest={manifest_digest(art)[:16]}")
    print(f"{len(roots) - failed} of {len(roots)} artifacts verify")
    return 1 if failed else 0


def card(run_root: str) -> int:
    """`cpt-to-sft card RUN_ROOT`: export/README.md rendered again from the run's records."""
    from tasks.core.config.schema import RunConfig
    from tasks.core.run.stages import ROWS, RUN_JSON, Status
    from tasks.core.storage.fs import RunStore
    from tasks.flowkit.stage import StageResult
    from tasks.stages.export import write_card

    try:
        summary = json.loads(RunStore(run_root).read_text(RUN_JSON))
    except (OSError, ValueError) as exc:
        print(
            f"FAILED: {run_root}: no readable {RUN_JSON} ({type(exc).__name__}: {exc}); give the root of a run",
            file=sys.stderr,
        )
        return 1
    if not summary.get("config"):
        print(
            f"FAILED: {run_root}/{RUN_JSON} records no config (written before run.json kept it); run the flow again "
            "over this "
            "run root: every stage is skipped and the card is written",
            file=sys.stderr,
        )
        return 1
    cfg = RunConfig.model_validate({**summary["config"], "run_root": run_root})
    results = {
        s["stage"]: StageResult(s["stage"], Status(s["status"]), detail=s.get("detail") or {})
        for s in summary["stages"]
    }
    export = results.get(ROWS.export.name)
    if export is None or export.status not in (Status.COMPLETED, Status.SKIPPED):
        print(
            f"FAILED: {run_root}: the run has no export to write a card into (export: {export.status if export else 'not-run'})",
            file=sys.stderr,
        )
        return 1
    uri, changed = write_card(cfg, results, metrics=summary.get("evaluation"))
    print(f"{uri}: {'written' if changed else 'unchanged'}")
    return 0


def schema() -> dict[str, Any]:
    from tasks.core.config.schema import RunConfig

    out = RunConfig.model_json_schema()
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return out


def _print(text: str) -> int:
    """Print for a pipe: `cpt-to-sft schema | head` closing early is no error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python would report the broken pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


RUN_HELP = """Run the flow: load, prepare the data, train CPT, evaluate, train SFT, export, evaluate, gate, push.

The config file is YAML (a local path or an fsspec URI): examples/tiny-cpu.yaml is the
demo; every field, its default and its rules: `cpt-to-sft schema`. `--set key.path=value` overrides
one field, the value parsed as YAML (`--set cpt.lr=1e-4` is a float, `--set hub=null` removes the
push), applied in the order given and validated like the file. `--stop-after STAGE` runs the stages
up to STAGE and records the rest as not-run. Without PREFECT_API_URL the run starts its own Prefect
server. A re-run skips every stage whose artifact verifies and whose config is unchanged."""

RUN_EXAMPLES = """examples:
  cpt-to-sft run --config examples/tiny-cpu.yaml
  cpt-to-sft run --config my.yaml --set cpt.max_steps=100 --set cpt.lr=1e-4 --set hub=null
  cpt-to-sft run --config s3://bucket/configs/8b.yaml --run-root s3://bucket/runs/8b --stop-after export

exit status: 0 complete, or stopped after --stop-after; 1 a stage failed or the config is refused;
3 the gate failed (artifacts kept, nothing pushed); 75 preempted more often than <phase>.elastic.max_preemptions
(the checkpoint stands: run again); 130 interrupted (Ctrl-C)"""


def _epilog() -> str:
    width = max(map(len, COMMANDS))
    lines = ["commands (`cpt-to-sft COMMAND --help` for each one's options):"]
    lines += [f"  {name:<{width}}  {text}" for name, (text, _) in COMMANDS.items()]
    lines += ["", "examples:"] + [f"  {example}" for _, example in COMMANDS.values()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="cpt-to-sft",
        usage="cpt-to-sft [-h] [--version] COMMAND ...",
        description="CPT -> SFT on ColossalAI, orchestrated by Prefect.",
        epilog=_epilog(),
        formatter_class=raw,
    )
    parser.add_argument("--version", action="version", version=f"cpt-to-sft {version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND", help=argparse.SUPPRESS)
    run = sub.add_parser("run", help=COMMANDS["run"][0], description=RUN_HELP, epilog=RUN_EXAMPLES, formatter_class=raw)
    _config_args(run)
    add_stop_after(run)
    _config_args(
        sub.add_parser(
            "check",
            help=COMMANDS["check"][0],
            description="Pre-flight only: every problem at once; exit 1 on any, 0 when clean. Launches nothing.",
        )
    )
    _config_args(sub.add_parser("break-lease", help=COMMANDS["break-lease"][0]))
    for name, (_, text) in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    v = sub.add_parser(
        "verify",
        help=COMMANDS["verify"][0],
        description="Verify an artifact or every artifact of a run root: manifests, sizes, sha256, the model-folder "
        "rule, fingerprints.",
    )
    v.add_argument("path", help="an artifact directory (holding .cpt-to-sft/manifest.json) or a run root")
    v.add_argument(
        "--no-fingerprint",
        action="store_true",
        help="skip recomputing the logits of HF-format artifacts (no model is loaded)",
    )
    sub.add_parser("schema", help=COMMANDS["schema"][0])
    c = sub.add_parser(
        "card",
        help=COMMANDS["card"][0],
        description="Render the model card of a finished run into its export/README.md again, from the "
        "run's records (run.json with its config, train states, evaluation, the export's manifest); the push uploads "
        "this file.",
    )
    c.add_argument(
        "run_root", metavar="RUN_ROOT", help="the run root (local path or s3://...) holding run.json and export/"
    )
    _flow_alias(sub)
    return parser


FLOW_EPILOG = (
    "exit status: 0 complete (pushed, or no hub configured), or stopped after --stop-after; 1 a stage "
    "failed; 3 the gate failed (artifacts kept, nothing pushed); 75 preempted more often than "
    "<phase>.elastic.max_preemptions (run again: it resumes); 130 interrupted (Ctrl-C)"
)


def _flow_alias(sub: Any) -> None:
    """`python -m flows.cpt_to_sft`, the runbook's alias, as a command of this parser left out of the
    listing (`flow_main` parses its argv under it): the `run` command's options without --set, and
    --check and --break-lease in place of those commands."""
    f = sub.add_parser(
        FLOW_ALIAS,
        prog="python -m flows.cpt_to_sft",
        description="The `cpt-to-sft` flow: continued pre-training then supervised fine-tuning on ColossalAI.",
        epilog=FLOW_EPILOG,
    )
    _config_args(f, sets=False)
    f.add_argument(
        "--break-lease", action="store_true", help="remove the run root's lease left by a dead run, then exit"
    )
    f.add_argument(
        "--check",
        action="store_true",
        help="pre-flight only: print the report, exit 1 on any problem, 0 when clean; starts nothing",
    )
    add_stop_after(f)


def main(argv: list[str] | None = None) -> int:
    from tasks.core.errors import ConfigError

    console = (
        argv is None
    )  # the installed command, not a caller in this process (whose Prefect settings may be its own)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return DELEGATED[argv[0]][0](argv[1:])
    args = build_parser().parse_args(argv)
    if console and args.cmd == "run":
        from flows.embedded_api import prestart

        prestart()  # its start-up runs beside the config's reading and the flow's imports (flows/embedded_api.py)
    if args.cmd == "schema":
        return _print(json.dumps(schema(), indent=2))
    if args.cmd == "verify":
        return verify(args.path, fingerprints=not args.no_fingerprint)
    if args.cmd == "card":
        return card(args.run_root)
    if args.cmd == FLOW_ALIAS:
        return _flow(args)
    try:
        cfg = resolved_config(args.config, args.sets, args.run_root, args.run_name)
    except ConfigError as exc:  # a refusal, as pre-flight's: 1, the status `python -m flows.cpt_to_sft` gives it
        print(str(exc), file=sys.stderr)
        return 1
    return _config_command(args, cfg)


def _config_command(args: argparse.Namespace, cfg: Any) -> int:
    """run, check or break-lease on the config read by `main` (`cfg`). `run` hands the flow the user's
    config and overrides as given, not `cfg`: the retry after a preemption reads the file again (what
    capacity came back is said there while the run waits), with the same --set items applied."""
    if args.cmd == "check":
        from tasks.flowkit.preflight import run_check_cli

        return run_check_cli(cfg)
    if args.cmd == "break-lease":
        return break_lease(cfg)
    from tasks.core.config.overrides import RunOverrides

    # --run-root and --run-name as --set items after the others (they win, as in `resolved_config`), each
    # value a JSON string (YAML reads it back exactly): a refusal names the config's field, as `check` does.
    named = [f"{k}={json.dumps(v)}" for k, v in (("run_root", args.run_root), ("name", args.run_name)) if v]
    return run_flow(args.config, RunOverrides(sets=(*args.sets, *named)), args.stop_after)


def break_lease(cfg: Any) -> int:
    """Remove the run root's lease left by a dead run, saying whose it was."""
    from tasks.core.storage.lease import break_lease as break_it
    from tasks.core.storage.lease import describe
    from tasks.flowkit.stage import store_for

    old = break_it(store_for(cfg))
    print(f"lease on {cfg.run_uri}: " + (f"broken (was held by {describe(old)})" if old else "none held"))
    return 0


def flow_main(argv: list[str] | None = None) -> int:
    """`python -m flows.cpt_to_sft`: the flow reads the config itself, with --run-root and --run-name as
    its `overrides` parameter (`cpt-to-sft run` adds its --set items to them as `sets`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return _flow(build_parser().parse_args([FLOW_ALIAS, *argv]))


def _flow(args: argparse.Namespace) -> int:
    from tasks.core.config.overrides import RunOverrides

    if args.check:
        from tasks.flowkit.preflight import run_check_cli

        return run_check_cli(args.config, run_root=args.run_root, run_name=args.run_name)
    overrides = RunOverrides(run_root=args.run_root or "", run_name=args.run_name or "")
    if args.break_lease:
        from flows.cpt_to_sft import resolve_config

        return break_lease(resolve_config(args.config, overrides))
    return run_flow(args.config, overrides, args.stop_after)


def run_flow(config: str, overrides: Any, stop_after: str | None) -> int:
    """Run the flow in this process to its end; the exit status (EXIT_* above, 1 for a failure)."""
    import atexit
    import gc

    import flows.cpt_to_sft  # noqa: F401 - first: importing Prefect sets up the console handlers filtered below
    from flows.console import console_guard
    from tasks.flowkit.console_log import one_line_failures

    # The imports of a run (torch, transformers, Prefect: about 450k objects) live until the process
    # exits, where the interpreter's final collections would walk them all, a wait at every exit.
    # Frozen by an exit handler that runs after Prefect's and the embedded server's (registered
    # later, they run first), they are left to the OS.
    atexit.unregister(gc.freeze)  # once per process, however often this runs in it
    atexit.register(gc.freeze)
    # To the last line printed: a run outlives the reader of its output, and a failure is that one
    # line (the traceback is in the task run's log, tasks/flowkit/console_log.py).
    with console_guard(), one_line_failures():
        return _run_flow(config, overrides, stop_after)


def _run_flow(config: str, overrides: Any, stop_after: str | None) -> int:
    import flows.cpt_to_sft as runbook
    from flows.embedded_api import ApiUnavailable, embedded_api
    from tasks.core.errors import PREEMPTED_EXIT
    from tasks.flowkit.run import gate_message
    from tasks.flowkit.stage import PREEMPTED_STATE

    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        with embedded_api():
            state = runbook.cpt_to_sft(config=config, overrides=overrides, stop_after=stop_after, return_state=True)
    except ApiUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    except runbook.Interrupted as exc:  # before or after the stages: nothing of the run to tear down
        print(exc, file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, previous)
    if state.is_cancelled():
        print(state.message or state.name, file=sys.stderr)
        return EXIT_INTERRUPTED
    if state.is_failed() and state.name == PREEMPTED_STATE:
        # Preempted more often than elastic.max_preemptions allows: the checkpoint stands, run again (EX_TEMPFAIL).
        print(state.message or state.name, file=sys.stderr)
        return PREEMPTED_EXIT
    if not state.is_completed():
        # Refused at pre-flight (the report), the lease held, or a stage failed (its cause): the
        # state message says which; the last line printed is the reason.
        print(state.message or state.name, file=sys.stderr)
        return 1
    summary = state.result()
    gate_ = summary.get("gate") or {}
    # One line, for scripts: the table above is for people.
    print(
        json.dumps(
            {
                "run_root": summary["run_root"],
                "complete": summary["complete"],
                "export": summary["export"],
                "seconds": summary["seconds"],
                "gate": gate_.get("status"),
            }
        )
    )
    if gate_.get("passed") is False:
        print(gate_message(gate_), file=sys.stderr)
        return EXIT_FAILED_GATE
    return 0 if summary["complete"] or summary.get("stopped_after") else 1


def _on_sigint(signum, frame) -> None:
    from flows.cpt_to_sft import Interrupted

    signal.signal(signal.SIGINT, _exit_at_once)
    print(
        "interrupted: stopping the run (ending the stage, writing run.json, releasing the lease); Ctrl-C again exits "
        "at once",
        file=sys.stderr,
        flush=True,
    )
    raise Interrupted("interrupted by SIGINT (Ctrl-C)")


def _exit_at_once(signum, frame) -> None:
    # No cleanup: the run's processes go with this one (reap_on_exit), the lease expires or is broken.
    os._exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
