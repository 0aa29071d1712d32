"""The training side of prepared data: blocks (CPT) or rows (SFT) read from memory-mapped shards.

    python -m tasks.core.data.dataset /tmp/prep --seq-len 256      # counts and the first item

Start-up reads index.json and one small offsets array per SFT file, never a token; a shard is
memory-mapped the first time an item touches it. So start-up time and RSS depend on the number of
files, not on the corpus size, and the page cache (shared by every rank on a node) holds the
tokens. Items are what the in-memory path built, bit for bit:
- CPT: each source's blocks are tokens [b*seq_len, (b+1)*seq_len) of the training streams of its
  files in index order (each document followed by eos), i.e. pack_cpt over the same records; the
  tail of each source is dropped, so no block straddles two sources. Item ids are source-major
  (source 0's blocks first); with one source (data.uri) that is the whole corpus.
- SFT: item i is the i-th kept training conversation, right-padded to seq_len with pad_token_id,
  labels -100 off the assistant tokens and on padding, as encode_sft builds it.
`num_items` and integer indices are all ResumableSampler needs; a mixture's `blend()` is the
memory-mapped stream of item ids prepare_data blended (tasks/core/data/blend.py), which the sampler
walks instead of a permutation.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tasks.core.config.phases import PHASES
from tasks.core.data.index import INDEX

BLEND_FILE = "blend.items"  # tasks.core.data.blend's name; not imported, so a rank's reader pulls in numpy only

IGNORE_INDEX = -100  # tasks.core.data.samples's value; not imported, so a rank's reader pulls in numpy only


class TokenDataset:
    def __init__(self, prepared_dir: str | Path, seq_len: int | None = None, split: str = "train"):
        self.root = Path(prepared_dir)
        try:
            self.index = json.loads((self.root / INDEX).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.root}: no {INDEX}; the data was not prepared (run the prepare_data stage)"
            ) from None
        self.kind = self.index["kind"]
        self.phase = PHASES[self.kind]  # blocks of one stream, or a record a row
        self.split = split
        self.seq_len = int(seq_len or self.index["seq_len"])
        if self.phase.rows and self.seq_len != self.index["seq_len"]:
            raise ValueError(
                f"the {self.phase.title} data in {self.root} was prepared for seq_len={self.index['seq_len']}, "
                f"not {self.seq_len}: "
                "prepare it again with this seq_len"
            )
        self.pad = int(self.index["pad_token_id"])
        files = self.index["files"]
        self._dirs = [self.root / f["shard"] for f in files]
        self._dtypes = [
            np.dtype(json.loads((d / "summary.json").read_text())["dtype"])
            if self.index["dtype"] == "mixed"
            else np.dtype(self.index["dtype"])
            for d in self._dirs
        ]
        self._maps: dict[tuple[int, str], np.ndarray] = {}
        # An index made before mixtures has no `sources`: its files are one source.
        self.sources = self.index.get("sources") or [{"name": "main", "files": [0, len(files)]}]
        if self.phase.blocks:
            counts = np.array([f[split]["tokens"] for f in files], dtype=np.int64)
            self.total_tokens = int(counts.sum())
            # Each file's tokens in one coordinate: source s's kept blocks start where source s-1's
            # end, and a file's range is cut at its source's last whole block.
            self._starts, self._ends = np.zeros(len(files), np.int64), np.zeros(len(files), np.int64)
            base = 0
            for src in self.sources:
                a, b = src["files"]
                within = np.concatenate([[0], np.cumsum(counts[a:b])])
                kept = (int(within[-1]) // self.seq_len) * self.seq_len
                self._starts[a:b] = base + np.minimum(within[:-1], kept)
                self._ends[a:b] = base + np.minimum(within[1:], kept)
                base += kept
            self.num_items = base // self.seq_len
        else:
            counts = np.array([f[split]["records"] for f in files], dtype=np.int64)
            self.num_items = int(counts.sum())
            self._ends = np.cumsum(counts)
            self._starts = self._ends - counts

    def __len__(self) -> int:
        return self.num_items

    def blend(self) -> np.ndarray | None:
        """The blended stream of item ids (a mixture's training side), memory-mapped; None for one source."""
        meta = self.index.get("blend")
        if self.split != "train" or not meta:
            return None
        if self.phase.blocks and self.seq_len != self.index["seq_len"]:
            raise ValueError(
                f"the mixture in {self.root} was blended in blocks of seq_len={self.index['seq_len']}, not "
                f"{self.seq_len}: prepare it again with this seq_len"
            )
        return np.memmap(self.root / meta["file"], dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r")

    def _map(self, f: int, what: str) -> np.ndarray:
        key = (f, what)
        m = self._maps.get(key)
        if m is None:
            path = self._dirs[f] / f"{self.split}.{what}"
            dtype = {"offsets": np.dtype(np.int64), "mask": np.dtype(np.uint8)}.get(what, self._dtypes[f])
            # np.memmap refuses an empty file; an empty side is an empty array.
            m = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
            self._maps[key] = m
        return m

    def _check(self, i: int) -> int:
        i = int(i)
        if not 0 <= i < self.num_items:
            raise IndexError(f"item {i} is outside the {self.num_items} {self.split} items of {self.root}")
        return i

    def _block(self, i: int) -> np.ndarray:
        start = self._check(i) * self.seq_len
        end = start + self.seq_len
        out = np.empty(self.seq_len, np.int64)
        f = int(np.searchsorted(self._ends, start, side="right"))
        filled = 0
        while filled < self.seq_len:
            local = start + filled - int(self._starts[f])
            take = min(self.seq_len - filled, int(self._ends[f]) - (start + filled))
            if take > 0:
                out[filled : filled + take] = self._map(f, "tokens")[local : local + take]
                filled += take
            f += 1
        assert start + filled == end
        return out

    def _doc_starts(self, i: int) -> np.ndarray:
        """Where a document starts inside CPT block i (block positions, 0 always among them): from
        each touched file's offsets, every document being its tokens and eos; a file starts one too."""
        start = self._check(i) * self.seq_len
        out, filled = [np.zeros(1, np.int64)], 0
        f = int(np.searchsorted(self._ends, start, side="right"))
        while filled < self.seq_len:
            lo = start + filled - int(self._starts[f])
            take = min(self.seq_len - filled, int(self._ends[f]) - (start + filled))
            if take > 0:
                off = self._map(f, "offsets")
                a, b = np.searchsorted(off, [lo, lo + take], side="left")
                out.append(np.asarray(off[a:b], np.int64) - lo + filled)
                filled += take
            f += 1
        return np.unique(np.concatenate(out))

    def batch_documents(self, indices: Sequence[int], width: int | None = None) -> dict[str, np.ndarray]:
        """CPT blocks with their documents kept apart (`cpt.attention: document`): {"input_ids",
        "labels", "position_ids", "segment_ids"} as int64 arrays [len(indices), seq_len], the same
        tokens as `batch`. Each document's piece in a block is numbered (segment_ids 1, 2, ...) and its
        position ids restart at 0, as a packed SFT row's conversations (`batch_packed`); a piece's
        first token is not a label, so no document learns from the one before it."""
        if not PHASES[self.kind].blocks:
            blocks = " or ".join(n for n, row in PHASES.items() if row.blocks)
            raise ValueError(
                f"document attention needs {blocks} data (blocks of a document stream); {self.root} holds "
                f"{self.kind} rows"
            )
        out = self.batch(indices)
        n, L = out["input_ids"].shape
        pos, seg = np.zeros((n, L), np.int64), np.zeros((n, L), np.int64)
        for r, i in enumerate(indices):
            starts = self._doc_starts(i)
            first = np.zeros(L, np.int64)
            first[starts] = 1
            seg[r] = np.cumsum(first)
            pos[r] = np.arange(L) - starts[seg[r] - 1]
            out["labels"][r, starts] = IGNORE_INDEX
        return {**out, "position_ids": pos, "segment_ids": seg}

    def _row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        i = self._check(i)
        f = int(np.searchsorted(self._ends, i, side="right"))
        j = i - int(self._starts[f])
        off = self._map(f, "offsets")
        a, b = int(off[j]), int(off[j + 1])
        return np.asarray(self._map(f, "tokens")[a:b], np.int64), np.asarray(self._map(f, "mask")[a:b], bool)

    def lengths(self) -> np.ndarray:
        """Real tokens of every item, in item order (one offsets array per file, no token read)."""
        if self.phase.blocks:
            return np.full(self.num_items, self.seq_len, np.int64)
        return np.concatenate(
            [np.diff(np.asarray(self._map(f, "offsets"), np.int64)) for f in range(len(self._dirs))]
            or [np.zeros(0, np.int64)]
        )

    def batch(self, indices: Sequence[int], width: int | None = None) -> dict[str, np.ndarray]:
        """{"input_ids", "labels"[, "attention_mask"]} as int64 arrays [len(indices), width]; SFT rows
        are right-padded to `width` (default seq_len), which must hold the longest of them."""
        n, L = len(indices), self.seq_len
        if width is not None and self.phase.rows:
            L = int(width)
        if self.phase.blocks:
            ids = np.stack([self._block(i) for i in indices]) if n else np.zeros((0, L), np.int64)
            return {"input_ids": ids, "labels": ids.copy()}
        ids = np.full((n, L), self.pad, np.int64)
        labels = np.full((n, L), IGNORE_INDEX, np.int64)
        attn = np.zeros((n, L), np.int64)
        for r, i in enumerate(indices):
            x, m = self._row(i)
            k = len(x)
            if k > L:
                raise ValueError(f"item {i} has {k} tokens, more than the batch width {L}")
            ids[r, :k] = x
            labels[r, :k] = np.where(m, x, IGNORE_INDEX)
            attn[r, :k] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": attn}

    def batch_packed(self, rows: Sequence[Sequence[int]], width: int | None = None) -> dict[str, np.ndarray]:
        """Packed SFT rows, each holding several items back to back: {"input_ids", "labels",
        "position_ids", "segment_ids"} as int64 arrays [len(rows), width]. Position ids restart at
        0 with each item; segment_ids number a row's items 1, 2, ... (0 is padding), from which the
        engine builds the attention that keeps items apart (`tasks.engine.packing`). An item's first
        token is never a label, so no item learns from the one before it, as no padded row's first
        token is (the causal loss predicts token t from the tokens before t)."""
        if not self.phase.rows:
            raise ValueError(f"packing needs sft data; {self.root} holds {self.kind} data")
        n, L = len(rows), int(width) if width is not None else self.seq_len
        ids = np.full((n, L), self.pad, np.int64)
        labels = np.full((n, L), IGNORE_INDEX, np.int64)
        pos = np.zeros((n, L), np.int64)
        seg = np.zeros((n, L), np.int64)
        for r, items in enumerate(rows):
            at = 0
            for s, i in enumerate(items, start=1):
                x, m = self._row(i)
                k = len(x)
                if at + k > L:
                    raise ValueError(f"row {r} holds {at + k} tokens with item {i}, more than the batch width {L}")
                ids[r, at : at + k] = x
                labels[r, at : at + k] = np.where(m, x, IGNORE_INDEX)
                labels[r, at] = IGNORE_INDEX
                pos[r, at : at + k] = np.arange(k)
                seg[r, at : at + k] = s
                at += k
        return {"input_ids": ids, "labels": labels, "position_ids": pos, "segment_ids": seg}

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {k: v[0] for k, v in self.batch([i]).items()}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tasks.core.data.dataset")
    ap.add_argument("prepared_dir")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--split", default="train", choices=["train", "heldout"])
    a = ap.parse_args(argv)
    ds = TokenDataset(a.prepared_dir, a.seq_len, a.split)
    print(f"{ds.kind} {a.split}: {ds.num_items} items of seq_len {ds.seq_len}; totals {json.dumps(ds.index['totals'])}")
    if ds.num_items:
        print({k: v[:16].tolist() for k, v in ds[0].items()})


if __name__ == "__main__":
    main()
