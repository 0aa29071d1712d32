"""Regenerate the committed sample corpora: a fictional star system, the Veyra system.

    python data/sample/make_samples.py            # rewrites cpt.jsonl, sft.jsonl, general.jsonl and dpo.jsonl here

The facts are invented so no pretrained model knows them, and the prose is templated so a
tiny model's held-out loss drops within a few dozen steps: the point is to *see* CPT teach the
domain and SFT teach the chat format, in seconds on a laptop. Output is a pure function of
SEED: re-running it must leave `git diff` empty.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20240607
N_CPT = 600
N_SFT = 200
HERE = Path(__file__).resolve().parent

# One row per planet: the whole "domain". Kept small so every fact recurs many times.
PLANETS = [
    # name,     colour,     moons, day_h, year_d, gas,        rings, discoverer,        crop
    ("Zorvath", "crimson", 3, 19, 212, "argon", True, "Ilse Marrow", "glassroot"),
    ("Quellin", "teal", 0, 31, 88, "neon", False, "Tobias Fenn", "saltmoss"),
    ("Ardemis", "amber", 5, 11, 540, "xenon", True, "Ilse Marrow", "emberwheat"),
    ("Novaro", "violet", 1, 27, 365, "nitrogen", False, "Kaito Vell", "duskberry"),
    ("Pelleth", "silver", 2, 44, 701, "helium", True, "Rhea Okonkwo", "frostbean"),
    ("Brisca", "ochre", 7, 9, 129, "krypton", False, "Tobias Fenn", "ironcane"),
    ("Tamsor", "jade", 4, 22, 980, "methane", True, "Kaito Vell", "mistcorn"),
    ("Ulvane", "cobalt", 0, 53, 47, "oxygen", False, "Rhea Okonkwo", "sunreed"),
    ("Kerrow", "scarlet", 6, 15, 430, "argon", False, "Ilse Marrow", "stoneleaf"),
    ("Fennick", "pearl", 2, 38, 615, "neon", True, "Kaito Vell", "glassroot"),
]
FIELDS = ("name", "colour", "moons", "day", "year", "gas", "rings", "discoverer", "crop")
STAR = "Veyra"

FACT_TEMPLATES = [
    "{name} is a {colour} planet that orbits the star {star}.",
    "Seen from afar, {name} glows {colour} against the dark.",
    "{name} has {moons_text}.",
    "The number of moons around {name} is {moons}.",
    "A day on {name} lasts {day} hours.",
    "{name} turns once on its axis every {day} hours.",
    "One year on {name} is {year} days long.",
    "{name} takes {year} days to circle {star}.",
    "The air of {name} is mostly {gas}.",
    "The dominant gas in the atmosphere of {name} is {gas}.",
    "{name} {rings_text}.",
    "{name} was first charted by {discoverer}.",
    "The astronomer {discoverer} discovered {name}.",
    "Farmers on {name} grow {crop}.",
    "The main crop of {name} is {crop}.",
]
COMPARE_TEMPLATES = [
    "{a} has more moons than {b}.",
    "A year on {a} is longer than a year on {b}.",
    "A day on {a} is longer than a day on {b}.",
]

SYSTEM_PROMPTS = [
    "You are a concise guide to the Veyra system.",
    "Answer in one short sentence.",
    "You are an astronomy tutor. Be brief.",
]
# (question template, answer template): answers stay short on purpose (SFT teaches format).
QA = [
    ("What colour is {name}?", "{name} is {colour}."),
    ("How many moons does {name} have?", "{name} has {moons_text}."),
    ("How long is a day on {name}?", "A day on {name} lasts {day} hours."),
    ("How long is a year on {name}?", "A year on {name} is {year} days."),
    ("What is the air of {name} made of?", "Mostly {gas}."),
    ("Does {name} have rings?", "{rings_answer}"),
    ("Who discovered {name}?", "{discoverer} discovered {name}."),
    ("What do farmers grow on {name}?", "They grow {crop}."),
    ("Which star does {name} orbit?", "{name} orbits {star}."),
]
FOLLOW_UPS = [
    ("And how many moons?", "{name} has {moons_text}."),
    ("What about its year?", "A year on {name} is {year} days."),
    ("Who found it?", "{discoverer} found it."),
    ("And its main crop?", "Its main crop is {crop}."),
    ("Does it have rings?", "{rings_answer}"),
]


def facts(row: tuple) -> dict:
    d = dict(zip(FIELDS, row))
    m = d["moons"]
    d["star"] = STAR
    d["moons_text"] = "no moons" if m == 0 else ("one moon" if m == 1 else f"{m} moons")
    d["rings_text"] = "is circled by bright rings" if d["rings"] else "has no rings"
    d["rings_answer"] = f"Yes, {d['name']} has rings." if d["rings"] else f"No, {d['name']} has no rings."
    return d


def cpt_record(rng: random.Random) -> dict:
    p = facts(rng.choice(PLANETS))
    sentences = [t.format(**p) for t in rng.sample(FACT_TEMPLATES, rng.randint(3, 6))]
    if rng.random() < 0.3:
        a, b = (facts(r) for r in rng.sample(PLANETS, 2))
        key = rng.choice(["moons", "year", "day"])
        if a[key] < b[key]:
            a, b = b, a
        if a[key] != b[key]:
            sentences.append(COMPARE_TEMPLATES[["moons", "year", "day"].index(key)].format(a=a["name"], b=b["name"]))
    return {"text": " ".join(sentences)}


def sft_record(rng: random.Random, i: int) -> dict:
    p = facts(rng.choice(PLANETS))
    q, a = rng.choice(QA)
    messages = []
    # Fixed mix by index (not by chance) so every shape is always present: a third with a
    # system message, 40% with a second assistant turn.
    if i % 3 == 0:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages += [{"role": "user", "content": q.format(**p)}, {"role": "assistant", "content": a.format(**p)}]
    if i % 5 in (1, 3):
        fq, fa = rng.choice(FOLLOW_UPS)
        messages += [{"role": "user", "content": fq.format(**p)}, {"role": "assistant", "content": fa.format(**p)}]
    return {"messages": messages}


# general.jsonl: everyday prose, not about Veyra: the "general" source a CPT mixture replays beside
# the domain (examples/tiny-cpu-mixture.yaml). Its own generator, so cpt.jsonl and
# sft.jsonl are the bytes they were before it existed.
N_GENERAL = 300
GENERAL_SEED = SEED + 1
PEOPLE = ("Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas")
PLACES = (
    "the market",
    "the library",
    "the station",
    "the park",
    "the bakery",
    "the harbour",
    "the school",
    "the museum",
)
THINGS = ("bread", "apples", "a map", "an umbrella", "a book", "tea", "a bicycle", "soup", "a letter", "coffee")
WEATHER = ("rainy", "sunny", "windy", "cold", "warm", "foggy")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
GENERAL_TEMPLATES = [
    "On {day} {who} walked to {place} to buy {thing}.",
    "The weather was {weather}, so {who} stayed near {place} for most of the afternoon.",
    "{who} told a friend that {thing} from {place} is the best in town.",
    "Every {day}, {who} reads for an hour before dinner.",
    "It was {weather} in the morning, and the streets around {place} were quiet.",
    "{who} forgot {thing} at {place} and went back to fetch it.",
    "A small crowd waited outside {place} until the doors opened at nine.",
    "{who} prefers {weather} days, when {place} is less busy.",
]


def general_record(rng: random.Random) -> dict:
    slots = lambda: {
        "who": rng.choice(PEOPLE),
        "place": rng.choice(PLACES),
        "thing": rng.choice(THINGS),
        "weather": rng.choice(WEATHER),
        "day": rng.choice(DAYS),
    }
    return {"text": " ".join(t.format(**slots()) for t in rng.sample(GENERAL_TEMPLATES, rng.randint(3, 5)))}


# dpo.jsonl: preference pairs for the DPO phase, one layout in four pairs of each kind (docs/data-formats.md):
# the chosen reply states the planet's fact, the rejected one another planet's. Its own generator, so the
# other files are the bytes they were before it existed (and the demo tokenizer, trained on cpt and sft, too).
N_DPO = 120
DPO_SEED = SEED + 2


def dpo_record(rng: random.Random, i: int) -> dict:
    row = rng.choice(PLANETS)
    p = facts(row)
    q, a = rng.choice(QA)
    chosen = a.format(**p)
    others = [r for r in PLANETS if a.format(**facts(r)) != chosen]
    rejected = a.format(**facts(rng.choice(others)))
    prompt = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if i % 3 == 0 else []
    prompt.append({"role": "user", "content": q.format(**p)})
    form = i % 4
    if form == 0:  # strings: the prompt is one user turn
        return {"prompt": prompt[-1]["content"], "chosen": chosen, "rejected": rejected}
    if form == 1:  # message lists
        return {
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        }
    if form == 2:  # a shared conversation with two endings
        return {"messages": prompt, "chosen": {"role": "assistant", "content": chosen}, "rejected": rejected}
    return {  # two whole dialogues, no prompt: what they share is the prompt
        "chosen": [*prompt, {"role": "assistant", "content": chosen}],
        "rejected": [*prompt, {"role": "assistant", "content": rejected}],
    }


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def main() -> None:
    rng = random.Random(SEED)
    write_jsonl(HERE / "cpt.jsonl", [cpt_record(rng) for _ in range(N_CPT)])
    write_jsonl(HERE / "sft.jsonl", [sft_record(rng, i) for i in range(N_SFT)])
    general = random.Random(GENERAL_SEED)
    write_jsonl(HERE / "general.jsonl", [general_record(general) for _ in range(N_GENERAL)])
    dpo = random.Random(DPO_SEED)
    write_jsonl(HERE / "dpo.jsonl", [dpo_record(dpo, i) for i in range(N_DPO)])
    for name in ("cpt.jsonl", "sft.jsonl", "general.jsonl", "dpo.jsonl"):
        print(f"{HERE / name}: {(HERE / name).stat().st_size} bytes")


if __name__ == "__main__":
    main()
