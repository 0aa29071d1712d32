"""The data sections of a stage's configuration: its corpus or weighted mixture (`data`), how the files are
tokenized (`data.tokenize`), and the held-out-only sources (`eval.heldout_sources`). Re-exported by
`tasks.core.config.schema`, where the phase section is assembled.

    python -c "from tasks.core.config.data import DataConfig; print(sorted(DataConfig.model_fields))"
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.core.config.base import Frozen


class LocalClusterConfig(Frozen):
    n_workers: int = Field(
        default=2, ge=1, description="Worker processes of the dask.distributed LocalCluster (one thread each)."
    )


class TokenizeConfig(Frozen):
    """How prepare_data runs its tokenize tasks; never part of a digest (the shards are the same bytes)."""

    workers: int = Field(
        default=2,
        ge=1,
        description="Process-pool workers (Prefect's ProcessPoolTaskRunner) when no Dask cluster is named; 1 file or "
        "chunk per worker at a time.",
    )
    chunk_mb: float = Field(
        default=64.0,
        gt=0,
        description="A file larger than this (MB, 2**20 bytes) is tokenized in chunks cut at record boundaries "
        "(JSONL/text: byte ranges; parquet: row groups; compressed: decompressed once and cut), spread "
        "over the workers; halved down to 1 MB while the files to tokenize would give fewer than 4 chunks "
        "per worker. The prepared shards are the same bytes whatever the chunking.",
    )
    dask_address: str | None = Field(
        default=None,
        description="Scheduler address of a running Dask cluster (tcp://host:8786): the files are tokenized on its "
        "workers (prefect-dask DaskTaskRunner).",
    )
    local_cluster: LocalClusterConfig | None = Field(
        default=None,
        description="Start a dask.distributed LocalCluster of n_workers processes for this stage instead of the "
        "process pool.",
    )

    @model_validator(mode="after")
    def _one_runner(self) -> TokenizeConfig:
        if self.dask_address and self.local_cluster:
            raise ValueError(
                "give tokenize.dask_address (a running cluster) or tokenize.local_cluster (start one), not both"
            )
        return self


SOURCE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
MAIN_SOURCE = "main"  # the one source `data.uri` stands for


class DataSource(Frozen):
    """One corpus of a weighted mixture (`data.sources`)."""

    name: str = Field(
        pattern=SOURCE_NAME,
        description="The source's name: it labels the source in the blend report, the UI, the manifest and the card.",
    )
    uri: str | list[str] = Field(
        description="What data.uri accepts: one file, a glob, a directory or a list of those, on any fsspec URI."
    )
    weight: float = Field(
        default=1.0,
        description=(
            "Share of the stage's training samples drawn from this source (CPT: of the seq_len blocks, so of the "
            "tokens; SFT: of the "
            "conversations); the weights are normalized to sum to 1. A source smaller than its share is repeated, a "
            "larger one subsampled."
        ),
    )

    @model_validator(mode="after")
    def _positive_weight(self) -> DataSource:
        if not self.weight > 0:  # also refuses NaN
            raise ValueError(
                f"source {self.name!r}: weight {self.weight} must be > 0 (weights are normalized to sum to 1); remove "
                "the source to leave it out"
            )
        return self

    @property
    def uris(self) -> list[str]:
        return [self.uri] if isinstance(self.uri, str) else list(self.uri)


class DataConfig(Frozen):
    uri: str | list[str] | None = Field(
        default=None,
        description=(
            "The corpus: one file, a glob, a directory (every file of data.formats below it, default .jsonl/.parquet, "
            "optionally .gz/.bz2/.xz/.zst), "
            "or a list of those (concatenated: one source); any fsspec URI (local, NFS, s3://). Read once by "
            "prepare_data into token "
            "shards under data/cpt/ or data/sft/. The one-source shorthand of sources (a source named 'main'); give "
            "one of the two."
        ),
    )
    sources: list[DataSource] | None = Field(
        default=None,
        description=(
            "A weighted mixture: [{name, uri, weight}], e.g. 70 % domain text and 30 % general replay. prepare_data "
            "decides once, from "
            "the seed and the weights, which source and which sample feed every position of the planned steps "
            "(max_steps x the global "
            "batch), like Megatron-LM's BlendedDataset; CPT blocks never straddle two sources."
        ),
    )
    strict_weights: bool = Field(
        default=False,
        description=(
            "data.sources weights that do not sum to 1 are normalized, and pre-flight says so with the shares used; "
            "true: refused "
            "instead, so a typo in a weight cannot change the mixture. A check only: not part of any digest."
        ),
    )
    max_source_epochs: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Warn (pre-flight, estimated; prepare_data, exact) when the planned steps would repeat a source more than "
            "this many times. "
            "A warning only: not part of any digest."
        ),
    )
    formats: tuple[Literal["jsonl", "parquet", "txt"], ...] = Field(
        default=("jsonl", "parquet"),
        min_length=1,
        description=(
            "What a directory named in uri/sources is read for (each optionally .gz/.bz2/.xz/.zst); every other file "
            "in it is not data, "
            "named once by pre-flight. Plain text (txt, one record a line) is read from a directory only when listed "
            "here, since any notes "
            "file is a .txt; a file or glob named directly is read whatever its format."
        ),
    )
    text_field: str = Field(default="text", description="CPT: the record field holding raw text (jsonl/parquet).")
    messages_field: str = Field(default="messages", description="SFT: the record field holding the chat messages.")
    on_bad_record: Literal["error", "skip"] = Field(
        default="error",
        description=(
            "A record that does not parse, is not UTF-8, lacks the field, or (SFT) breaks the chat rules: 'error' "
            "stops prepare_data "
            "naming its file and line; 'skip' leaves it out and counts it (manifest and UI)."
        ),
    )
    max_bad_records: int = Field(
        default=100,
        ge=0,
        description="With on_bad_record: skip, prepare_data fails when more records than this are bad.",
    )
    max_record_chars: int = Field(
        default=1 << 24,
        ge=1,
        description="A record longer than this (characters of its JSON) is a bad record: a guard against a missing "
        "newline swallowing a file.",
    )
    tokenize: TokenizeConfig = Field(
        default_factory=TokenizeConfig,
        description="Where the files are tokenized: a local process pool (default) or a Dask cluster.",
    )

    @model_validator(mode="after")
    def _one_corpus(self) -> DataConfig:
        # One field, the fix in the message: the loader names the path (<phase>.data).
        if (self.uri is None) == (self.sources is None):
            raise ValueError(
                "give data.uri (one corpus) or data.sources (a weighted mixture), not both and not neither"
            )
        if self.sources is not None and not self.sources:
            raise ValueError("data.sources is empty: list at least one {name, uri, weight}, or give data.uri")
        seen: set[str] = set()
        for s in self.sources or ():
            if s.name in seen:
                raise ValueError(f"data.sources: the name {s.name!r} is given twice; each source needs its own name")
            seen.add(s.name)
        return self

    @property
    def source_list(self) -> list[DataSource]:
        """The sources of this stage: data.sources, or data.uri as one source named 'main'."""
        return list(self.sources) if self.sources is not None else [DataSource(name=MAIN_SOURCE, uri=self.uri)]

    @property
    def mixture(self) -> bool:
        """More than one source: training reads a blend (tasks/core/data/blend.py)."""
        return len(self.source_list) > 1

    @property
    def uris(self) -> list[str]:
        """Every source's uris, in source order."""
        return [u for s in self.source_list for u in s.uris]

    @property
    def folder_formats(self) -> tuple[str, ...]:
        """data.formats as file suffixes (what `tasks.core.data.inputs.resolve_inputs` takes)."""
        return tuple(f".{f}" for f in self.formats)


class HeldoutSource(Frozen):
    """A held-out-only source (`cpt.eval.heldout_sources`): text evaluated, never trained on."""

    name: str = Field(
        pattern=SOURCE_NAME,
        description=(
            "The source's name: it labels its perplexity in metrics.json, run.json, the evaluation table and the "
            "card, and its limit in "
            "gate.cpt_max_ppl_increase_pct."
        ),
    )
    uri: str | list[str] = Field(
        description="What data.uri accepts: one file, a glob, a directory or a list of those, on any fsspec URI; "
        "records with data.text_field."
    )

    @property
    def uris(self) -> list[str]:
        return [self.uri] if isinstance(self.uri, str) else list(self.uri)
