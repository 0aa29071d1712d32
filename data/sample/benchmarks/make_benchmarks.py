"""Regenerate the demo's lm-evaluation-harness tasks from the sample domain (../make_samples.py).

    python data/sample/benchmarks/make_benchmarks.py     # rewrites veyra_facts.jsonl and general_text.jsonl beside this file

- veyra_facts: a multiple-choice cloze per planet and fact (crop, gas, colour, discoverer): the
  sentence the CPT corpus states it with, cut before the answer, and four candidates of that kind.
  CPT on ../cpt.jsonl teaches these facts, so the export's accuracy moves from chance.
- general_text: everyday prose drawn from the general source's templates with their own seed, so
  none of it is a record of ../general.jsonl: a perplexity task on text no stage trains on, the
  forgetting check.
The task YAMLs (veyra_facts.yaml, general_text.yaml) are written by hand; the output is a pure
function of the seeds: re-running leaves `git diff` empty.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import make_samples as s

SEED = s.SEED + 2
N_GENERAL = 24
# (fact, the corpus's sentence up to the answer)
CLOZES = {
    "crop": "The main crop of {name} is",
    "gas": "The dominant gas in the atmosphere of {name} is",
    "colour": "Seen from afar, {name} glows",
    "discoverer": "{name} was first charted by",
}


def fact_records(rng: random.Random) -> list[dict]:
    out = []
    for row in s.PLANETS:
        p = s.facts(row)
        for fact, stem in CLOZES.items():
            right = p[fact]
            others = sorted({s.facts(r)[fact] for r in s.PLANETS} - {right})
            choices = [right, *rng.sample(others, 3)]
            rng.shuffle(choices)
            out.append({"question": stem.format(**p), "choices": choices, "answer": choices.index(right), "fact": fact})
    return out


def main() -> None:
    rng = random.Random(SEED)
    s.write_jsonl(HERE / "veyra_facts.jsonl", fact_records(rng))
    seen = {json.loads(line)["text"] for line in (HERE.parent / "general.jsonl").read_text().splitlines()}
    general = [r for r in (s.general_record(rng) for _ in range(4 * N_GENERAL)) if r["text"] not in seen][:N_GENERAL]
    s.write_jsonl(HERE / "general_text.jsonl", general)
    for name in ("veyra_facts.jsonl", "general_text.jsonl"):
        print(f"{HERE / name}: {(HERE / name).stat().st_size} bytes")


if __name__ == "__main__":
    main()
