"""The package's rooms import only downwards, and no module uses another module's private names
(docs/design.md §13); in the package, tools/ and the tests only train/build.py reaches the
model, DDP and optimizer builders (§9).

Read statically with ``ast`` (every import statement, at module level or inside a function), so
a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_boost"

#: The rooms from the lowest to the highest (docs/design.md §13). A module may import from its
#: own room and from rooms below it, never from one above.
ROOMS = ("compat", "runtime", "data", "config", "analysis", "parallel", "model", "measure",
         "perf", "train", "convert", "testing", "cli", "__main__")

#: Rooms of plain Python: no import of torch or megatron-core in any of their modules, at the top
#: or inside a function (analysis/: the formulas, from shapes only; measure/ runs the layers).
TORCH_FREE_ROOMS = ("analysis",)


def _modules() -> Iterator[Tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(p for p in parts if p != "__init__"), path


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> Iterator[Tuple[int, str, Tuple[str, ...]]]:
    """(line, imported module, imported names) of every import of a megatron_boost module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "megatron_boost":
            yield node.lineno, node.module, tuple(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "megatron_boost":
                    yield node.lineno, alias.name, ()


def upward_imports():
    """'module:line imports target' for every import from a higher room."""
    found = []
    for module, path in _modules():
        room = _room(module)
        if room not in ROOMS:
            continue  # the package root (__init__) and console wrappers
        for line, target, names in _imports(path):
            for name in names or ("",):
                full = f"{target}.{name}" if name else target
                target_room = _room(target) or _room(full)
                if target_room in ROOMS and ROOMS.index(target_room) > ROOMS.index(room):
                    found.append(f"{module}:{line} imports {full} ({room} -> {target_room})")
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_aliases(tree: ast.AST) -> dict:
    """Local name -> megatron_boost module, for names bound to a module of the package
    (``import megatron_boost.x.y as z``, ``from megatron_boost.x import y``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("megatron_boost.") and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module \
                and node.module.split(".")[0] == "megatron_boost":
            base = PACKAGE.parent.joinpath(*node.module.split("."))
            for a in node.names:
                if (base / f"{a.name}.py").is_file() or (base / a.name).is_dir():
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def private_imports():
    """'module:line uses target._name' for every private name taken from another module, by
    import or as an attribute of an imported module."""
    found = []
    for module, path in _modules():
        tree = ast.parse(path.read_text())
        for line, target, names in _imports(path):
            if target != module:
                found += [f"{module}:{line} imports {target}.{n}" for n in names
                          if _is_private(n)]
        aliases = _module_aliases(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and _is_private(node.attr)
                    and aliases[node.value.id] != module):
                found.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}."
                             f"{node.attr}")
    return found


def test_every_module_is_in_a_room():
    rooms = {_room(m) for m, _ in _modules()} - {""}
    assert rooms == set(ROOMS), f"rooms not in the order: {sorted(rooms - set(ROOMS))}"


def test_no_import_from_a_higher_room():
    assert upward_imports() == []


def test_no_private_name_from_another_module():
    assert private_imports() == []


def torch_imports(rooms=TORCH_FREE_ROOMS):
    """'module:line imports name' for every import of torch or megatron in ``rooms``."""
    found = []
    for module, path in _modules():
        if _room(module) not in rooms:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{module}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in ("torch", "megatron")]
    return found


def test_the_formula_rooms_import_no_torch():
    """analysis/ holds the formulas (FLOPs, communication, the rank's shapes), read from shapes
    with plain Python; what runs the layers (torch, megatron-core) is measure/."""
    assert torch_imports() == []


@pytest.mark.parametrize("source,expect", [
    ("from megatron_boost.train.step import train_step\n", "upward"),
    ("from megatron_boost.model.specs import _self_group\n", "private"),
    ("from megatron_boost.model import specs\nspecs._self_group()\n", "private"),
    ("def count():\n    import torch\n    return torch\n", "torch"),
])
def test_the_checks_see_a_violation(tmp_path, monkeypatch, source, expect):
    """Negative control: a module of the analysis room that imports upwards, a private name, or
    torch (lazily) is reported."""
    fake = tmp_path / "megatron_boost"
    for room in ROOMS:
        (fake / room).mkdir(parents=True)
        (fake / room / "__init__.py").write_text("")
    (fake / "analysis" / "bad.py").write_text(source)
    (fake / "model" / "specs.py").write_text("def _self_group():\n    pass\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    found = {"upward": upward_imports, "private": private_imports,
             "torch": torch_imports}[expect]()
    assert len(found) == 1 and "megatron_boost.analysis.bad:" in found[0], found


def room_dependencies() -> dict:
    """room -> the other rooms it imports from, in room order, read from the import graph."""
    deps = {room: set() for room in ROOMS}
    for module, path in _modules():
        room = _room(module)
        if room not in ROOMS:
            continue
        for _, target, names in _imports(path):
            for name in names or ("",):
                target_room = _room(target) or _room(f"{target}.{name}" if name else target)
                if target_room in ROOMS and target_room != room:
                    deps[room].add(target_room)
    return {room: sorted(found, key=ROOMS.index) for room, found in deps.items()}


def test_the_design_documents_room_table_is_the_import_graph():
    """docs/design.md §13's "imports from" table states what each room imports: the claims
    about rooms (analysis measures the model's layers; perf works from shapes only) are read
    from the imports, not written by hand."""
    import re

    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    table = text.split("| room | imports from |")[1].split("\n\n")[0]
    rows = dict(re.findall(r"^\| (\w+) \| ([\w, —]+) \|$", table, re.M))
    documented = {room: [] if deps.strip() == "—" else deps.strip().split(", ")
                  for room, deps in rows.items()}
    assert documented == room_dependencies()


# ---------------------------------------------------------------------------------------------
# one builder (docs/design.md §9): only train/build.py reaches the model, DDP and optimizer,
# in the package, tools/ and tests/
# ---------------------------------------------------------------------------------------------

#: What builds a run's pieces, and the one function that may call each: the model class in
#: model/gpt.py's build_model, megatron's DDP wrapper and optimizer factory in train/step.py's
#: lower builders, and those lower builders in train/build.py (build_ddp_model calls
#: build_model; build_optimizer calls build_muon_optimizer for optimizer.name: muon).
#: cli/gpu_check.py and measure/layer_comm.py's build_decoder_layer build single decoder layers,
#: none of these. One test is exempt: tests/test_cpu_mode.py runs megatron-core's own GPTModel
#: (its local spec, not this project's model) to show CPU mode carries megatron's code paths.
_BUILDERS = {
    "GPTModel": {("megatron_boost/model/gpt.py", "build_model"),
                 ("tests/test_cpu_mode.py", "_megatron_gpt_tp2_pp2")},
    "BottleneckGPTModel": {("megatron_boost/model/gpt.py", "build_model")},
    "DistributedDataParallel": {("megatron_boost/train/step.py", "build_ddp_model")},
    "get_megatron_optimizer": {("megatron_boost/train/step.py", "build_optimizer"),
                               ("megatron_boost/train/muon.py", "build_muon_optimizer")},
    "build_muon_optimizer": {("megatron_boost/train/step.py", "build_optimizer")},
    "build_model": {("megatron_boost/train/step.py", "build_ddp_model"),
                    ("megatron_boost/train/build.py", "_inference_chunks")},
    "build_ddp_model": {("megatron_boost/train/build.py", "build_run")},
    "build_optimizer": {("megatron_boost/train/build.py", "build_run")},
}


def _calls(tree: ast.AST) -> Iterator[Tuple[int, str, str]]:
    """(line, enclosing top-level function, called name) of every call by name or attribute."""
    for top in tree.body:
        for node in ast.walk(top):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                yield node.lineno, getattr(top, "name", "<module>"), name


def _builder_calls_out_of_place(root: Path, sources) -> list:
    wrong = []
    for path in sources:
        rel = path.relative_to(root).as_posix()
        for line, where, name in _calls(ast.parse(path.read_text())):
            if name in _BUILDERS and (rel, where) not in _BUILDERS[name]:
                wrong.append(f"{rel}:{line} ({where}) calls {name}")
    return wrong


def test_only_the_one_builder_builds_model_ddp_and_optimizer():
    """The package, tools/ and the tests build a run through train/build.py's build_run:
    nothing else constructs GPTModel / BottleneckGPTModel or megatron's
    DistributedDataParallel, calls get_megatron_optimizer, or calls the lower builders that
    do. This file is left out: its back-door fixture below is such a call, as text."""
    root = PACKAGE.parent
    tests = [p for p in sorted((root / "tests").glob("*.py")) if p.name != Path(__file__).name]
    sources = [*sorted(PACKAGE.rglob("*.py")), *sorted((root / "tools").glob("*.py")), *tests]
    assert _builder_calls_out_of_place(root, sources) == []


def test_the_builder_check_finds_a_back_door(tmp_path):
    tool = tmp_path / "tools" / "t.py"
    tool.parent.mkdir()
    tool.write_text("def main():\n    ddp = step.build_ddp_model(config, 64, 16, 1, device='cpu')\n"
                    "    return DistributedDataParallel(config, ddp_config, ddp[0])\n")
    assert _builder_calls_out_of_place(tmp_path, [tool]) == [
        "tools/t.py:2 (main) calls build_ddp_model",
        "tools/t.py:3 (main) calls DistributedDataParallel"]
