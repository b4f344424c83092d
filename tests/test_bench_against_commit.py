"""scripts/bench_against_commit.py: its bad input is refused in one line before any worktree is
built (a commit that does not exist, one from before the benchmark, ``--runs 0``, an ``--out``
that cannot be written), a checkout with uncommitted changes is labelled as such, and nothing
is left behind (no worktree, no temporary folder) on success or failure.

On a small git repository made here (two commits: one before the benchmark existed, one with
it), the script's ``main`` in this process with the repository as its root; the benchmark run
itself is replaced by a stand-in writing a report (what is tested is the script around it)."""

import importlib.util
import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.test_training import ROOT

pytestmark = pytest.mark.fast


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "bench_against_commit", ROOT / "scripts" / "bench_against_commit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          cwd=repo, check=True, capture_output=True, text=True,
                          timeout=60).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A repository whose first commit predates the benchmark and whose second has it."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    (repo / "configs").mkdir()
    _git(repo, "init", "-q")
    (repo / "README").write_text("x\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "before the benchmark")
    (repo / "tools" / "benchmark.py").write_text("")
    (repo / "configs" / "bench-cpu.yaml").write_text("")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "the benchmark")
    return repo


@pytest.fixture
def script(repo, tmp_path, monkeypatch):
    """The script rooted at ``repo``, its temporary folders under ``tmp_path/tmp`` (to see
    that none is left), its benchmark a stand-in."""
    module = _load_script()
    monkeypatch.setattr(module, "ROOT", repo)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    module.bench_calls = []

    def bench(tree: Path, out: Path, steps: int) -> dict:
        assert (tree / "tools" / "benchmark.py").is_file()
        module.bench_calls.append(out.name)
        out.write_text(json.dumps({"modes": {}}))
        return {"full": 2.0, "naive": 1.5, "boost": 1.0}

    monkeypatch.setattr(module, "_bench", bench)
    return module


def _worktrees(repo: Path) -> int:
    return _git(repo, "worktree", "list").count("\n") + 1


def _refused(script, capsys, argv, needles) -> None:
    try:
        code = script.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1, err
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    assert "Traceback" not in err
    assert script.bench_calls == []


def test_bad_input_is_refused_before_any_worktree(script, repo, tmp_path, capsys):
    first = _git(repo, "rev-list", "--max-parents=0", "HEAD")
    out = str(tmp_path / "r.txt")
    cases = [(["--commit", "deadbeef", "--out", out], ("'deadbeef'", "names no commit")),
             (["--commit", first[:7], "--out", out],
              (first[:7], "before the benchmark existed", "tools/benchmark.py")),
             (["--commit", "HEAD", "--runs", "0", "--out", out], ("--runs", "0", ">= 1")),
             (["--commit", "HEAD", "--out", str(tmp_path / "none" / "r.txt")],
              ("--out", "does not exist")),
             (["--commit", "HEAD", "--out", "/proc/r.txt"], ("--out", "cannot create"))]
    for argv, needles in cases:
        _refused(script, capsys, argv, needles)
        assert _worktrees(repo) == 1
    assert not Path(out).exists()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_clean_checkout_is_labelled_by_its_head_and_nothing_is_left(script, repo, tmp_path,
                                                                       capsys):
    out = tmp_path / "r.txt"
    assert script.main(["--commit", "HEAD~0", "--runs", "2", "--out", str(out)]) == 0
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert f"this checkout ({head}, 'after')" in out.read_text()
    assert script.bench_calls == ["before1.json", "after1.json", "before2.json", "after2.json"]
    assert list((tmp_path / "tmp").iterdir()) == [] and _worktrees(repo) == 1


def test_a_dirty_checkout_is_labelled_dirty(script, repo, tmp_path):
    (repo / "README").write_text("changed\n")
    (repo / "new.py").write_text("")
    out = tmp_path / "r.txt"
    assert script.main(["--commit", "HEAD", "--runs", "1", "--out", str(out)]) == 0
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert f"this checkout ({head}-dirty (2 files differ from {head}), 'after')" \
        in out.read_text()


def test_nothing_is_left_when_a_run_fails(script, repo, tmp_path, monkeypatch):
    def failing(tree, out, steps):
        out.write_text("{}")
        raise RuntimeError("the benchmark crashed")

    monkeypatch.setattr(script, "_bench", failing)
    with pytest.raises(RuntimeError, match="crashed"):
        script.main(["--commit", "HEAD", "--out", str(tmp_path / "r.txt")])
    assert list((tmp_path / "tmp").iterdir()) == [] and _worktrees(repo) == 1


def test_raw_reports_are_kept_where_asked(script, repo, tmp_path):
    raw = tmp_path / "raw"
    assert script.main(["--commit", "HEAD", "--runs", "1", "--out", str(tmp_path / "r.txt"),
                        "--raw", str(raw)]) == 0
    assert sorted(p.name for p in raw.iterdir()) == ["after1.json", "before1.json"]
    assert list((tmp_path / "tmp").iterdir()) == []
