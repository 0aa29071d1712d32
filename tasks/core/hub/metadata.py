"""What the Hub accepts in the fields a push sends: repo ids, the card's license and tags.

    python -c "from tasks.core.hub.metadata import repo_id_problem; print(repo_id_problem(chr(0x43e) + 'rg/name'))"

Pre-flight reads these (`tasks.core.preflight.checks.check_hub`), so a value the Hub would refuse,
or one that only looks like the intended one, stops the run before training instead of at the push.

- Repo ids: huggingface_hub's `validate_repo_id` matches `[\\w.-]`, and Python's `\\w` is any
  Unicode letter, so 'org/name' spelled with a Cyrillic 'o' (U+043E) passes it; the Hub's own rule (the same
  docstring: "[a-zA-Z0-9] or '-', '_', '.'") is ASCII. A non-ASCII character is named with its
  code point and Unicode name, and the ASCII id it looks like is offered where every character has
  a known look-alike (`CONFUSABLES`, plus NFKC for full-width forms).
- License: one of the identifiers the Hub lists (https://huggingface.co/docs/hub/repositories-licenses),
  as `LICENSES` copies them, or `other`; the Hub refuses a model card whose `license` is none of
  them, which would fail the push after the training.
- Tags: `TAG` characters only (letters, digits, `-_.:+/`), at most `MAX_TAG` characters each and
  `MAX_TAGS` tags: a newline, markup or a quote is no tag the Hub's tag list shows as written.

The card's YAML front matter is dumped by huggingface_hub (`ModelCardData.to_yaml`, PyYAML with
quoting), and `tasks.core.hub.card` reads it back before writing it (`front_matter_problems`): a
value YAML does not keep as given (a NEL character, say) is an error naming the field, never a card
whose metadata says something else.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from typing import Any

# The Hub's license identifiers (its "Licenses" page, the table's second column) and `other`.
_LICENSE_IDS = """
    apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0
    bigcode-openrail-m afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda
    cc cc0-1.0 cc-by-2.0 cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0
    cc-by-nc-4.0 cc-by-nd-4.0 cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0
    cdla-sharing-1.0 cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 etalab-2.0
    eupl-1.1 eupl-1.2 agpl-3.0 gfdl gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc lppl-1.3c ms-pl mpl-2.0
    odc-by odbl openrail++ osl-3.0 postgresql ofl-1.1 ncsa unlicense zlib pddl lgpl-lr deepfloyd-if-license
    llama2 llama3 llama3.1 llama3.2 llama3.3 llama4 gemma apple-amlr apple-ascl
    fair-noncommercial-research-license intel-research openmdw-1.0 unknown other
"""
LICENSES = frozenset(_LICENSE_IDS.split())
LICENSES_URL = "https://huggingface.co/docs/hub/repositories-licenses"

REPO_PART = re.compile(r"[A-Za-z0-9_.-]+", re.ASCII)  # the Hub's characters of a namespace or a name
TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:+/-]*", re.ASCII)
MAX_TAG = 64
MAX_TAGS = 50

# Letters of other scripts drawn like an ASCII one (Unicode's confusables for Latin, the common ones).
CONFUSABLES = {
    **dict(
        zip(
            "\u0430\u0410\u0412\u0435\u0415\u0456\u0406\u0458\u0408\u041a\u041c\u041d\u043e\u041e\u0440\u0420\u0441\u0421"
            "\u0422\u0443\u0425\u0445\u0455\u0405\u0501\u051b\u051d\u04ae\u04bb\u04cf",
            "aABeEiIjJKMHoOpPcCTyXxsSdqwYhl",
            strict=True,
        )
    ),  # Cyrillic
    **dict(
        zip(
            "\u0391\u0392\u0395\u0396\u0397\u0399\u039a\u039c\u039d\u039f\u03a1\u03a4\u03a5\u03a7\u03b1\u03bf\u03c1"
            "\u03b9\u03c5\u03bd\u03ba",
            "ABEZHIKMNOPTYXaopiuvk",
            strict=True,
        )
    ),  # Greek
    "\u2010": "-",  # hyphen
    "\u2011": "-",  # non-breaking hyphen
    "\u2013": "-",  # en dash
    "\u2212": "-",  # minus sign
}


def _char(c: str) -> str:
    return f"{c!r} (U+{ord(c):04X} {unicodedata.name(c, 'unnamed')})"


def ascii_look_alike(value: str) -> str | None:
    """The ASCII string `value` is drawn like, where every non-ASCII character has a known look-alike."""
    out = []
    for c in value:
        if c.isascii():
            out.append(c)
            continue
        folded = unicodedata.normalize("NFKC", c)
        if folded.isascii() and folded:
            out.append(folded)
        elif c in CONFUSABLES:
            out.append(CONFUSABLES[c])
        else:
            return None
    return "".join(out)


def non_ascii_problem(value: str, what: str) -> str | None:
    """None for an ASCII value; else which characters are not ASCII and the ASCII `value` looks like."""
    odd = [(i, c) for i, c in enumerate(value) if not c.isascii()]
    if not odd:
        return None
    named = ", ".join(f"{_char(c)} at position {i}" for i, c in odd[:5]) + (" ..." if len(odd) > 5 else "")
    alike = ascii_look_alike(value)
    hint = f"; it looks like {alike!r}: type that" if alike and alike != value else ""
    return f"{value!r} is not ASCII: {named}; {what} takes ASCII characters only{hint}"


def repo_id_problem(repo_id: str) -> str | None:
    """Why the Hub would refuse `repo_id` as a model repo's 'org/name', or None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    rule = "a Hub repo id is 'org/name' of ASCII letters, digits, '-', '_', '.'"
    ascii_problem = non_ascii_problem(repo_id, rule.split(" is ")[0])
    if ascii_problem:
        return ascii_problem
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(REPO_PART.fullmatch(p) for p in parts):
        return f"{repo_id!r} is not a valid Hub repo id; {rule}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        return f"{repo_id!r} is not a valid Hub repo id ({str(exc).splitlines()[0]}); {rule}"
    return None


def license_problem(license: str) -> str | None:
    """Why the Hub would refuse `license` in a model card's metadata, or None."""
    ascii_problem = non_ascii_problem(license, "a license identifier")
    if ascii_problem:
        return ascii_problem
    if license in LICENSES:
        return None
    close = difflib.get_close_matches(license.lower().strip(), sorted(LICENSES), n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"{license[:80]!r} is not one of the Hub's license identifiers{hint}; use one that {LICENSES_URL} lists "
        "(e.g. 'apache-2.0', 'mit'), or 'other' for a license the Hub does not list"
    )


def tag_problems(tags: tuple[str, ...] | list[str]) -> list[str]:
    """Why each tag is no tag the Hub shows as written (characters, length), and a bound on their number."""
    out = []
    if len(tags) > MAX_TAGS:
        out.append(f"{len(tags)} tags; give at most {MAX_TAGS}")
    for i, tag in enumerate(tags):
        if not TAG.fullmatch(tag) or len(tag) > MAX_TAG:
            out.append(
                f"tag {i} {tag[:80]!r}{'...' if len(tag) > 80 else ''}: a tag is 1 to {MAX_TAG} ASCII letters, digits "
                "and '-_.:+/', starting with a letter or digit (no spaces, newlines, quotes or markup); "
                f"{'e.g. ' + repr(_slug(tag)) if _slug(tag) else 'remove it'}"
            )
    return out


def _slug(tag: str) -> str:
    """A tag's nearest safe form, offered in the message."""
    ascii_tag = ascii_look_alike(tag) or unicodedata.normalize("NFKD", tag).encode("ascii", "ignore").decode()
    cleaned = re.sub(r"[^A-Za-z0-9_.:+/-]+", "-", re.sub(r"<[^>]*>", "", ascii_tag)).strip("-_.:+/")
    return cleaned[:MAX_TAG]


def hub_field_problems(hub: Any, base_hub_id: str | None = None) -> list[tuple[str, str]]:
    """(field, message) for each value of `hub:` (a HubConfig) the Hub would refuse or show otherwise:
    repo ids, license, tags; and `base_model.hub_id`, which the card publishes as its base_model."""
    out: list[tuple[str, str]] = []
    for field, repo_id in (("hub.repo_id", hub.repo_id), ("hub.adapter_repo_id", hub.adapter_repo_id)):
        if repo_id is not None and (msg := repo_id_problem(repo_id)):
            out.append((field, msg))
    if base_hub_id is not None and (msg := repo_id_problem(base_hub_id)):
        out.append(("base_model.hub_id", msg))
    if hub.license is not None and (msg := license_problem(hub.license)):
        out.append(("hub.license", msg))
    out += [("hub.tags", msg) for msg in tag_problems(hub.tags)]
    return out


def front_matter_problems(meant: dict[str, Any], read: dict[str, Any]) -> list[str]:
    """The metadata fields whose value, read back from the card's front matter, is not the one meant."""
    return [k for k, v in meant.items() if v is not None and read.get(k) != v]


# The config field behind each metadata field the card writes, for the message when one does not read back.
METADATA_SOURCE = {
    "license": "hub.license",
    "tags": "hub.tags",
    "base_model": "base_model.hub_id (or the base model's Hub id)",
    "datasets": "cpt.data / sft.data uris",
    "model_name": "hub.repo_id",
}


def with_front_matter(data: Any, body: str) -> str:
    """The card's text, once its YAML front matter reads back as the metadata meant: a value YAML or the
    card parser would change (a line separator in a tag, say) is an error naming the config field, never a
    card whose metadata says something else or whose front matter ends early."""
    from huggingface_hub import ModelCard

    card = ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
    bad = front_matter_problems(data.to_dict(), card.data.to_dict())
    if bad:
        raise ValueError(
            "the model card's metadata would not read back as given for "
            + ", ".join(f"{k} (from {METADATA_SOURCE.get(k, k)})" for k in bad)
            + ": use plain ASCII values there (pre-flight's hub checks name which)"
        )
    return card.content
