"""The documentation: every Python example in README.md and docs/ runs as
written, and the site builds with no warning."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import docs_prelude

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
               if "```python\n" in p.read_text())


def examples(page: str) -> list[tuple[int, str]]:
    """The page's ```python blocks, with the line each starts on."""
    text = (ROOT / page).read_text()
    return [(text[:m.start()].count("\n") + 2, m[1])
            for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M)]


#: What marks a page whose examples need an optional package, and the package: skipped without it.
OPTIONAL = {"import grain": "grain", "flaxhooks.Wandb(": "wandb", "flaxhooks.MLflow(": "mlflow"}


def test_every_page_with_examples_is_tested():
    assert "README.md" in PAGES and len(PAGES) >= 10, PAGES
    assert sum(len(examples(p)) for p in PAGES) >= 11


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_every_python_example_runs_as_written(page, tmp_path, monkeypatch):
    """A page's examples run in order in one namespace, from a fresh
    working directory, with what ``tests/docs_prelude.py`` stands in for;
    W&B offline and silent, its settings, cache and logs in that directory."""
    text = (ROOT / page).read_text()
    for marker, package in OPTIONAL.items():
        if marker in text:
            pytest.importorskip(package, reason=f"optional: pip install 'flaxhooks[{package}]'")
    monkeypatch.chdir(tmp_path)
    for name, value in docs_prelude.offline_trackers(tmp_path).items():
        monkeypatch.setenv(name, value)
    namespace = docs_prelude.names()
    for line, code in examples(page):
        exec(compile("\n" * (line - 1) + code, str(ROOT / page), "exec"), namespace)


def test_the_site_builds_with_no_warning(tmp_path):
    """``mkdocs build --strict``: every link, anchor, page and docstring the
    API reference renders is sound."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    result = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
