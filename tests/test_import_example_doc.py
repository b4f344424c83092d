"""docs/import-example.md quotes docs/import-example.json, which scripts/import_example.sh
writes: every perplexity the page states is the file's, rounded as printed, and the page names
the command that regenerates the file (the run itself takes minutes: it is not repeated here)."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_page_quotes_the_generated_figures():
    doc = (ROOT / "docs" / "import-example.md").read_text()
    figures = json.loads((ROOT / "docs" / "import-example.json").read_text())
    assert figures["command"] == "scripts/import_example.sh" and "scripts/import_example.sh" in doc
    quoted = {float(x) for x in re.findall(r"\|\s*([0-9]+\.[0-9])\s*\|", doc)}
    expected = {round(v, 1) for v in figures["perplexity"].values()}
    assert quoted == expected, (quoted, expected)
    for key in ("full_rank_iterations", "continued_iterations"):
        assert f"{figures[key]} iterations" in doc, key
