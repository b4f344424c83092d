"""Every place docs/design.md cites exists in the repository.

The design document names code in two backticked forms, and both are checked here:

* a path: ``megatron_boost/config/transformer.py``, ``tools/comm_volume.py``, or a path inside the
  package without its prefix (``parallel/layers.py`` means ``megatron_boost/parallel/layers.py``);
  every backticked token that ends in a file suffix of the repository (.py .sh .yaml .sbatch
  .md) and has a ``/`` or is a top-level file must exist;
* a name in a path: ```name` in `path` ``, ```name` of `path` ``, ```name` (`path`) `` or
  ```name(args)` (`path`) ``, where the name is a function, class, method (``Class.method``)
  or module-level name; each dotted part must be defined in that file (``def``, ``class`` or an
  assignment);
* a private name alone (```_ReplayReduce` ``, ```_init_optimizer_state` ``): it must be defined
  somewhere in the repository, or in megatron-core when the text names megatron's private
  functions.

The test fails listing every citation that does not resolve, so a rename that leaves the
document behind is caught.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"

_SUFFIXES = (".py", ".sh", ".yaml", ".sbatch", ".md")
_PATH = r"[\w./*-]+(?:" + "|".join(re.escape(s) for s in _SUFFIXES) + r")"
#: `name` in `path` / `name` of `path` / `name` (`path` / `name(...)` (`path`
_NAME_IN_PATH = re.compile(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`\s+(?:in|of|\()\s*\(?`(" + _PATH
                           + r")`")
_BACKTICKED_PATH = re.compile(r"`(" + _PATH + r")`")
_PRIVATE_NAME = re.compile(r"`(_[A-Za-z][\w]*)(?:\([^`]*\))?`")
_CODE_DIRS = ("megatron_boost", "tools", "tests", "scripts")


def _resolve(path: str):
    """The file a cited path means, or None: from the repository root, else inside the
    package (the document drops the ``megatron_boost/`` prefix)."""
    for base in (ROOT, ROOT / "megatron_boost"):
        if (base / path).is_file():
            return base / path
    return None


def _defines(source: str, name: str) -> bool:
    """``name`` is a def, class or assignment (at any indentation) in ``source``."""
    n = re.escape(name)
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{n}\b|^\s*{n}\s*(?::[^=\n]*)?=",
                     source, re.M) is not None


def design_citations(text: str):
    """(paths, names-in-paths, private names) cited by ``text``; wrapped lines are joined
    first."""
    flat = " ".join(text.split())
    paths = sorted({p for p in _BACKTICKED_PATH.findall(flat)
                    if "*" not in p and ("/" in p or p.count(".") == 1)})
    names = sorted(set(_NAME_IN_PATH.findall(flat)))
    private = sorted(set(_PRIVATE_NAME.findall(flat)))
    return paths, names, private


def _sources_defining_private_names() -> list:
    """The text of every Python file of the repository and of megatron-core."""
    import megatron.core

    files = [f for d in _CODE_DIRS for f in (ROOT / d).rglob("*.py")]
    files += list(Path(megatron.core.__file__).parent.rglob("*.py"))
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def broken_citations(text: str) -> list:
    paths, names, private = design_citations(text)
    broken = [f"`{p}`: no such file" for p in paths if _resolve(p) is None]
    if private:
        sources = _sources_defining_private_names()
        broken += [f"`{n}`: defined nowhere in the repository or megatron-core"
                   for n in private if not any(_defines(src, n) for src in sources)]
    for name, path in names:
        file = _resolve(path)
        if file is None:
            continue  # reported above
        source = file.read_text(encoding="utf-8")
        missing = [part for part in name.split(".") if not _defines(source, part)]
        if missing:
            broken.append(f"`{name}` in `{path}`: {', '.join(missing)} not defined there")
    return broken


def test_design_doc_citations_exist():
    text = DESIGN.read_text(encoding="utf-8")
    paths, names, private = design_citations(text)
    # the parser still finds the citations (a change of the document's style would hide them)
    assert len(paths) >= 20 and len(names) >= 5 and len(private) >= 5, (paths, names, private)
    broken = broken_citations(text)
    assert not broken, "docs/design.md cites what is not there:\n" + "\n".join(broken)


def test_broken_citations_are_found():
    """The checker itself: a missing file, a missing name and a missing method are reported;
    real ones are not."""
    text = ("`megatron_boost/nowhere.py` and `cola_init_` in `parallel/layers.py`, "
            "`no_such_function` in `parallel/layers.py`, `record_collectives(group)` "
            "(`measure/collectives.py`), `_ReplayReduce`, `_get_cuda_rng_state` (megatron's), "
            "`_no_such_private()` and `BoostBottleneckGroup.no_such_method` in\n"
            "`parallel/layers.py`.")
    assert broken_citations(text) == [
        "`megatron_boost/nowhere.py`: no such file",
        "`_no_such_private`: defined nowhere in the repository or megatron-core",
        "`BoostBottleneckGroup.no_such_method` in `parallel/layers.py`: no_such_method not "
        "defined there",
        "`no_such_function` in `parallel/layers.py`: no_such_function not defined there",
    ]


def test_the_placement_block_is_the_table():
    """§2's placement block is the table of ``config/placement.py`` as it reads now."""
    from megatron_boost.config.placement import placement_markdown

    text = DESIGN.read_text()
    block = text.split("<!-- generated: placement -->\n", 1)[1].split("<!-- end generated", 1)[0]
    assert block == placement_markdown() + "\n", "run python scripts/render_docs.py"


def _section(text: str, number: int) -> str:
    return re.split(r"^## ", text.split(f"\n## {number}. ", 1)[1], maxsplit=1, flags=re.M)[0]


def test_the_communication_table_is_the_formula():
    """Each row of §5's per-layer table (MHA; CoLA-7B: d 4096, f 11008, r 1024) is what the
    formula, which reads the placement table, gives: symbols, collective count and the
    CoLA-7B forward elements per token."""
    from megatron_boost.analysis.comm import layer_comm_formula
    from megatron_boost.config.shape import MODES, ModelShape

    cola_7b = ModelShape("CoLA-7B", num_layers=32, hidden=4096, ffn=11008, heads=32,
                         attn_rank=1024, mlp_rank=1024)
    rows = re.findall(r"^\| (full|naive|boost) \| ([^|]+) \| ([^|]+) \| (\d+) \| (\d+) \|$",
                      _section(DESIGN.read_text(), 5), re.M)
    assert [r[0] for r in rows] == list(MODES)
    for mode, fwd, bwd, count, elems in rows:
        f = layer_comm_formula(cola_7b, mode)
        assert (fwd.strip(), bwd.strip(), int(count), int(elems)) == (
            f["fwd_formula"], f["bwd_formula"], f["fwd_count"] + f["bwd_count"],
            f["fwd_elems_per_token"]), mode


_SECTION_REF = re.compile(r"design\.md((?:[\s,(]*(?:and\s+)?§\d+(?:\.\d+)?)+)")


def _design_sections(text: str) -> set:
    """The numbers of design.md's sections and subsections ("2", "10.6")."""
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.?\s", text, re.M))


def section_references(root: Path = ROOT) -> list:
    """(file, section) of every citation of a design.md section: "docs/design.md §2, §5" in
    the code, scripts (Slurm's too), tests, configs, CI and documents, and every bare "§N"
    inside design.md itself."""
    refs = []
    for path in [p for d in _CODE_DIRS for ext in ("*.py", "*.sh", "*.sbatch")
                 for p in (root / d).rglob(ext)] + \
            [root / "README.md", *sorted((root / "docs").glob("*.md")),
             *sorted((root / "configs").glob("*.yaml")), *sorted((root / ".ci").iterdir())]:
        text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())
        found = (re.findall(r"§(\d+(?:\.\d+)?)", text) if path.name == "design.md" else
                 [n for m in _SECTION_REF.findall(text) for n in re.findall(r"§(\d+(?:\.\d+)?)", m)])
        refs += [(str(path.relative_to(root)), n) for n in found]
    return refs


def test_every_cited_section_exists():
    """A "docs/design.md §N" anywhere in the repository (and a "§N" inside design.md) names
    a section that exists: "§14" was cited for the version support of §15."""
    sections = _design_sections(DESIGN.read_text())
    missing = sorted({(f, n) for f, n in section_references() if n not in sections})
    assert not missing, missing


def _documented_returns():
    """(file, function, documented arity, returned arities) of every function of the package
    whose docstring says "Returns (a, b, ...)" and which returns tuples."""
    import ast

    found = []
    for path in sorted((ROOT / "megatron_boost").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = " ".join((ast.get_docstring(node) or "").split())
            m = re.search(r"Returns:? \(([^()]*(?:\([^()]*\)[^()]*)*)\)", doc)
            sizes = {len(r.value.elts) for r in ast.walk(node)
                     if isinstance(r, ast.Return) and isinstance(r.value, ast.Tuple)}
            if m and sizes:
                documented = len(re.split(r",(?![^()]*\))", m.group(1)))
                found.append((str(path.relative_to(ROOT)), node.name, documented, sizes))
    return found


def test_documented_return_tuples_match_the_code():
    """A docstring's "Returns (a, b)" has as many values as the function returns
    (``Trainer._check_inputs`` documented two and returned three)."""
    found = _documented_returns()
    assert any(name == "_check_inputs" for _, name, _, _ in found)
    assert [f for f in found if f[3] != {f[2]}] == []


def test_tools_are_shims_as_the_design_document_says():
    """§13: every ``tools/*.py`` but ``tools/init_time.py`` is a shim of a few lines calling
    its ``megatron_boost.cli`` main."""
    for path in sorted((ROOT / "tools").glob("*.py")):
        if path.name == "init_time.py":
            continue
        text = path.read_text()
        assert len(text.splitlines()) <= 4 and "from megatron_boost.cli." in text, path.name


def test_the_layer_docstring_says_how_weights_start():
    """parallel/layers.py's BottleneckGroup documents both starts: drawn and sliced with
    megatron's perform_initialization, left empty for the global init without it (the code
    path of _initial_shard)."""
    from megatron_boost.parallel.layers import BottleneckGroup

    doc = " ".join(BottleneckGroup.__doc__.split())
    assert "perform_initialization" in doc and "left empty" in doc
