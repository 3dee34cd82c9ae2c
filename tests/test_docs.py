"""The README and docs/*.md as users read them: their Python blocks run, their `tabfm` commands
use flags that exist, their links resolve inside the repository, and the README's test command
is the one CI runs. The convention is documented in docs/index.md ("How the code blocks are
tested"): every ```python block runs, in a fresh namespace and a fresh temporary working
directory, unless the line above its fence is `<!-- not run: REASON -->`."""
from __future__ import annotations

import functools
import linecache
import re
import subprocess
import sys
from pathlib import Path

import pytest
from threadpoolctl import threadpool_limits

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`([^`]+)`")
# `tabfm CMD`, `python -m tabfm CMD`, `torchrun ... -m tabfm.cli CMD`
COMMAND = re.compile(r"(?<![\w./-])(?<!from )(?<!import )tabfm(?:\.cli)?[ \t]+([a-z][\w-]*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
OUTSIDE = ("../shared", "/work/")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def blocks(path: Path) -> list[tuple[int, str, str, str | None]]:
    """(line of the opening fence, language, code, not-run reason or None) of each fenced block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        assert j < len(lines), f"{rel(path)}:{start + 1}: code block never closed"
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        reason = NOT_RUN.match(lines[k].strip()) if k >= 0 else None
        found.append((start + 1, lang, "\n".join(lines[start + 1:j]), reason.group(1) if reason else None))
        i = j + 1
    return found


def prose(path: Path) -> str:
    """The page without its fenced blocks (kept as blank lines, so line numbers stay)."""
    out, fence = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if line.startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a Markdown file's headings (a repeated heading gets -1, -2, ...)."""
    names, counts = set(), {}
    for line in prose(path).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            names.add(base if n == 0 else f"{base}-{n}")
    return frozenset(names)


# ------------------------------------------------------------------ links and paths
@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve_inside_the_repository(page):
    text = INLINE_CODE.sub("", prose(page))
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no heading #{fragment} in {rel(dest)}")
    assert not bad, f"{rel(page)}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_nothing_points_outside_the_repository(page):
    text = page.read_text(encoding="utf-8")
    hits = [f"line {n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if any(s in line for s in OUTSIDE)]
    assert not hits, f"{rel(page)} mentions paths outside the repository: {hits}"


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in PAGES[1:]:
        if page.name != "index.md":
            assert f"]({page.name})" in index, f"docs/index.md does not link {page.name}"
            assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


# ------------------------------------------------------------------ the test command
def test_readme_shows_the_command_ci_runs():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == "python3 -m pytest -q -n 2 --dist loadfile", f".ci/run ends with {ci[-1]!r}"
    assert any("pip install" in line and "torch==2.13.0" in line for line in ci)
    assert any("pip install" in line and '-e ".[test,serve,kernels,onnx]"' in line for line in ci)
    readme = ROOT / "README.md"
    shell = [code for _, lang, code, _ in blocks(readme) if lang in ("bash", "sh", "shell")]
    want = ('pip install torch==2.13.0 && pip install -e ".[test,serve,kernels,onnx]" && '
            'python3 -m pytest -q -n 2 --dist loadfile')
    assert want in shell, f"README.md has no block with exactly: {want}"
    assert "the exact command ci runs in `.ci/run`" in readme.read_text(encoding="utf-8").lower()


# ------------------------------------------------------------------ commands and flags
@functools.cache
def help_flags(command: str) -> frozenset[str] | None:
    """Flags `tabfm COMMAND --help` lists (None: no such command)."""
    run = subprocess.run([sys.executable, "-m", "tabfm", command, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    return frozenset(FLAG.findall(run.stdout)) if run.returncode == 0 else None


def command_lines(page: Path) -> list[tuple[str, str]]:
    """(where, text) of every shell line and inline code span that may hold a tabfm command."""
    out = []
    for line, lang, code, _ in blocks(page):
        if lang in ("bash", "sh", "shell", "console"):
            joined = re.sub(r"\\\n\s*", " ", code)
            for n, text in enumerate(joined.splitlines()):
                text = re.split(r"\s#", text, maxsplit=1)[0]
                out.append((f"{rel(page)}:{line + 1 + n}", text))
    for m in INLINE_CODE.finditer(prose(page)):
        out.append((f"{rel(page)} `{m.group(1)}`", m.group(1).replace("\n", " ")))
    return out


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_tabfm_commands_use_flags_that_exist(page):
    bad = []
    for where, text in command_lines(page):
        for m in COMMAND.finditer(text):
            command = m.group(1)
            flags = help_flags(command)
            if flags is None:
                bad.append(f"{where}: no command `tabfm {command}`")
                continue
            rest = COMMAND.split(text[m.end():])[0]  # up to the next tabfm command on the line
            rest = re.split(r"&&|\|\||;", rest)[0]
            missing = sorted(set(FLAG.findall(rest)) - flags)
            if missing:
                bad.append(f"{where}: `tabfm {command}` has no {', '.join(missing)}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ the Python blocks
def python_blocks() -> list:
    params = []
    for page in PAGES:
        for line, lang, code, reason in blocks(page):
            if lang not in ("python", "py"):
                continue
            marks = [pytest.mark.skip(reason=f"not run: {reason}")] if reason else []
            params.append(pytest.param(page, line, code, id=f"{rel(page)}:{line}", marks=marks))
    return params


def test_pages_have_runnable_python():
    runnable = {p.values[0].name for p in python_blocks() if not p.marks}
    assert "README.md" in runnable and len(runnable) >= 6, runnable


@pytest.mark.parametrize("page, line, code", python_blocks())
def test_python_block_runs(page, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    filename = f"{rel(page)}:{line}"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)  # tracebacks show it
    import scipy.optimize  # noqa: F401 - load the BLAS / OpenMP libraries the snippets use, so the limit reaches them
    import sklearn.linear_model  # noqa: F401
    import torch  # noqa: F401

    namespace = {"__name__": "__main__"}
    with threadpool_limits(limits=1):  # one BLAS / OpenMP thread: oversubscribed BLAS threads slow sklearn 3x
        exec(compile(code, filename, "exec"), namespace)  # noqa: S102 - the docs' own snippets
