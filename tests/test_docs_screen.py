"""The built site as a reader sees it, in headless Chromium: the front page's stage diagram is not
clipped (nor the concepts page's) and no name in a table's first column (the reference's fields) is broken across lines.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q -m integration tests/test_docs_screen.py

Measured, not eyeballed: a script added to a copy of each page writes what the browser laid out
into the DOM Chromium dumps (a code block wider than its box scrolls, hiding the end of its lines; an
inline `code` broken across lines has more than one client rectangle). Screenshots of the same
loads are kept under build/test-artifacts/docs/. Marked integration: a browser start costs seconds
of CPU; the strict build itself is tests/test_docs.py's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.servers.prefect_ops import chromium, ensure_chromium

REPO = Path(__file__).resolve().parent.parent
SCREENSHOTS = REPO / "build" / "test-artifacts" / "docs"
# A laptop's browser window, with the site's navigation and table of contents both shown (>= 1220 px).
WINDOW = "1280,1400"
MEASURE = """<pre id="measured"></pre><script>
window.addEventListener("load", () => {
  const clipped = [...document.querySelectorAll(".md-content pre > code")]
    .filter(c => Math.max(c.scrollWidth - c.clientWidth, c.parentElement.scrollWidth - c.parentElement.clientWidth) > 1)
    .map(c => c.textContent.split("\\n")[0].trim().slice(0, 60));
  const broken = [...document.querySelectorAll(".md-typeset td:first-child > code")]
    .filter(c => c.getClientRects().length > 1).map(c => c.textContent);
  const names = document.querySelectorAll(".md-typeset td:first-child > code").length;
  const scrolled = [...document.querySelectorAll(".md-typeset__scrollwrap")]
    .filter(w => w.scrollWidth > w.clientWidth + 1)
    .map(w => w.querySelector("th").textContent + ": " + (w.querySelector("td") || {}).textContent);
  document.getElementById("measured").textContent = JSON.stringify({clipped, broken, names, scrolled});
});
</script>"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--site-dir", str(out)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def measure(site: Path, page: str, name: str, tmp_path: Path) -> dict:
    binary, why = ensure_chromium()
    if binary is None:
        pytest.skip(f"headless Chromium unavailable: {why}")
    src = site / page
    probe = src.with_name("measured.html")  # beside the page: its relative CSS and links still resolve
    probe.write_text(src.read_text().replace("</body>", MEASURE + "</body>"))
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    dom = chromium(
        binary,
        probe.as_uri(),
        tmp_path / "profile",
        screenshot=SCREENSHOTS / f"{name}.png",
        window=WINDOW,
        budget_ms=5000,
    )
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.DOTALL)
    assert found and found.group(1), f"{page}: the measuring script did not run\n{dom[-2000:]}"
    return json.loads(found.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))


@pytest.mark.integration
@pytest.mark.parametrize("page", ["index", "concepts"])
def test_stage_diagram_is_not_clipped(site, tmp_path, page):
    got = measure(site, "index.html" if page == "index" else f"{page}/index.html", page, tmp_path)
    diagram = [c for c in got["clipped"] if c.startswith("1  load_from_hf")]
    assert not diagram, f"docs/{page}.md: the stage diagram is wider than the page and scrolls"


@pytest.mark.integration
def test_reference_field_names_stay_on_one_line(site, tmp_path):
    got = measure(site, "reference/config/index.html", "reference", tmp_path)
    assert got["names"] > 100, got  # the reference's field column is what is measured
    assert not got["broken"], f"docs/reference/config.md: field names broken across lines: {got['broken'][:10]}"
    # and their tables fit the page: only the registry tables of eight or nine columns scroll sideways
    fields = [t for t in got["scrolled"] if t.startswith("field:")]
    assert not fields, f"docs/reference/config.md: field tables wider than the page: {fields}"
