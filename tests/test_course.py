"""The course as a learner meets it: a main path within its reading budget, each notebook with its time and its
navigation, every relative link and anchor resolving, check cells collapsed, no path of the machine that ran the
committed outputs, and a main path that uses only what it has introduced.

`python tests/test_course.py` prints the per-notebook table (prose words, visible code lines, collapsed cells, time)."""

import ast
import json
import re
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

from tutorial_lib.cli import NAV_TAG, course_stats, notebook_stats

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ALL_NOTEBOOKS = sorted(NOTEBOOKS.glob("*.ipynb")) + sorted((NOTEBOOKS / "solutions").glob("*.ipynb"))

# The main path a learner can finish: at a careful reading pace about 2.7 h of prose, the rest code.
MAIN_PATH_WORDS = 24_000
MAIN_PATH_CODE_LINES = 4_500
FIRST_NOTEBOOK_WORDS = 2_500
NOTEBOOK_WORDS = 3_000


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def text(cell: dict) -> str:
    return "".join(cell["source"])


def test_the_main_path_fits_its_reading_budget():
    main = [s for s in course_stats(NOTEBOOKS) if s.main_path]
    assert [s.name[:2] for s in main] == [f"{n:02d}" for n in range(14)], [s.name for s in main]
    words, lines = sum(s.words for s in main), sum(s.code_lines for s in main)
    assert words <= MAIN_PATH_WORDS, f"main path: {words:,} words of prose (at most {MAIN_PATH_WORDS:,})"
    assert lines <= MAIN_PATH_CODE_LINES, (
        f"main path: {lines:,} visible lines of code (at most {MAIN_PATH_CODE_LINES:,})"
    )
    assert main[0].words <= FIRST_NOTEBOOK_WORDS, f"{main[0].name}: {main[0].words} words"
    long = {s.name: s.words for s in main if s.words > NOTEBOOK_WORDS}
    assert not long, f"main-path notebooks over {NOTEBOOK_WORDS:,} words: {long}"


def test_notebook_stats_count_what_a_learner_reads(tmp_path):
    nb = {
        "cells": [
            {"cell_type": "markdown", "metadata": {}, "source": ["# 99 · A title\n", "\n", "two words"]},
            {"cell_type": "code", "metadata": {}, "source": ["#| export\n", "x = 1\n", "\n", "y = 2"]},
            {
                "cell_type": "code",
                "metadata": {"jupyter": {"source_hidden": True}, "tags": ["check"]},
                "source": "a\nb",
            },
            {"cell_type": "markdown", "metadata": {"tags": [NAV_TAG]}, "source": "---\n**Next:** somewhere"},
        ]
    }
    path = tmp_path / "99_demo.ipynb"
    path.write_text(json.dumps(nb))
    s = notebook_stats(path)
    assert (s.title, s.words, s.code_lines, s.collapsed, s.checks) == ("99 · A title", 7, 2, 1, 1)
    assert s.main_path and s.minutes == 5


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb")), ids=lambda p: p.stem)
def test_every_course_notebook_states_its_time_and_ends_with_its_navigation(path):
    stats = {s.name: s for s in course_stats(NOTEBOOKS)}
    nb = cells(path)
    title = text(next(c for c in nb if c["cell_type"] == "markdown"))
    stated = re.search(r"^\*About (\d+) minutes to read and run", title, re.M)
    assert stated, f"{path.name}: no estimated time under the title (tutorial-lib course-map --write)"
    assert int(stated.group(1)) == stats[path.name].minutes, "the stated time is stale: tutorial-lib course-map --write"
    nav = nb[-1]
    assert NAV_TAG in nav["metadata"].get("tags", []), f"{path.name}: the last cell is not the navigation cell"
    links = set(re.findall(r"\]\(([^)#]+)", text(nav)))
    chapter = path.name[:2]
    if path.name[2] == "_":  # main path: the next notebook, its deep dives, its solutions
        names = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
        if path.name != names[-1]:
            assert names[names.index(path.name) + 1] in links, f"{path.name}: no link to the next notebook"
        dives = {p.name for p in NOTEBOOKS.glob(f"{chapter}[a-z]_*.ipynb")}
        assert dives <= links, f"{path.name}: deep dives not linked: {sorted(dives - links)}"
    else:  # a deep dive links back to its chapter
        assert any(link.startswith(chapter + "_") for link in links), f"{path.name}: no link back to its chapter"
    if (NOTEBOOKS / "solutions" / path.name).is_file():
        assert f"solutions/{path.name}" in links, f"{path.name}: no link to its solutions"


def jupyterlab_anchor(heading: str) -> str:
    """The id JupyterLab gives a rendered markdown heading: its text, spaces replaced by '-'."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    heading = re.sub(r"<[^>]+>", "", heading)
    heading = heading.replace("`", "").replace("**", "").replace("*", "")
    return heading.strip().replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found = set()
    for cell in cells(path):
        if cell["cell_type"] == "markdown":
            for line in text(cell).splitlines():
                if re.match(r"#{1,6} ", line):
                    found.add(jupyterlab_anchor(line.lstrip("#")))
            found.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text(cell)))
    return found


def markdown_links(path: Path) -> list[str]:
    if path.suffix == ".ipynb":
        sources = [text(c) for c in cells(path) if c["cell_type"] == "markdown"]
    else:
        sources = [path.read_text()]
    links = []
    for source in sources:
        source = re.sub(r"```.*?```", "", source, flags=re.S)  # code blocks hold no links
        links += re.findall(r"\]\(([^)\s]+)\)", source)
    return links


def test_every_relative_link_and_anchor_resolves():
    pages = ALL_NOTEBOOKS + [ROOT / "README.md"] + sorted((ROOT / "docs").glob("**/*.md"))
    broken = []
    for page in pages:
        for link in markdown_links(page):
            if re.match(r"[a-z]+:", link):  # https:, mailto:: not this course's pages
                continue
            target, _, anchor = unquote(link).partition("#")
            resolved = (page.parent / target).resolve() if target else page
            where = f"{page.relative_to(ROOT)} -> {link}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".ipynb" and anchor not in anchors(resolved):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_jupyterlab_anchors_keep_punctuation_and_drop_markup():
    assert jupyterlab_anchor(" 3. Counting in `optimizer` steps") == "3.-Counting-in-optimizer-steps"
    assert jupyterlab_anchor(" From one file to [`tutorial-train`](x.ipynb)") == "From-one-file-to-tutorial-train"


MACHINE_PATHS = re.compile(r"(/root/|/home/[a-z]|/work/|/tmp/tmp|/\.venv/|site-packages)")
# In a notebook's output any /tmp/ path is the machine's (a scratch folder is printed by its name); the guides may
# name a default such as /tmp/gpu_check.
OUTPUT_MACHINE_PATHS = re.compile(MACHINE_PATHS.pattern.replace("/tmp/tmp", "/tmp/"))


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=lambda p: str(p.relative_to(NOTEBOOKS)))
def test_committed_outputs_hold_no_path_of_the_machine_that_ran_them(path):
    found = []
    for i, cell in enumerate(cells(path)):
        for output in cell.get("outputs", []):
            shown = "".join(output.get("text", "")) + json.dumps(output.get("data", {}).get("text/plain", ""))
            found += [f"cell {i}: {m.group(0)}" for m in OUTPUT_MACHINE_PATHS.finditer(shown)]
    assert not found, f"{path.name}: paths of the machine in outputs (print them relative to the run): {found[:5]}"


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=lambda p: str(p.relative_to(NOTEBOOKS)))
def test_check_cells_are_collapsed_tagged_and_not_narrated(path):
    nb = cells(path)
    for i, cell in enumerate(nb):
        source = text(cell)
        if cell["cell_type"] == "code" and "assert" in source and "check passed" in source:
            meta = cell["metadata"]
            assert meta.get("jupyter", {}).get("source_hidden"), f"{path.name} cell {i}: a check cell not collapsed"
            assert "check" in meta.get("tags", []), f"{path.name} cell {i}: a check cell without the 'check' tag"
            before = text(nb[i - 1]) if i else ""
            assert not re.match(r"\s*\*\*Check", before), f"{path.name} cell {i - 1}: a 'Check' paragraph (fold it in)"


def tutorial_train_flags() -> set[str]:
    from tutorial_lib.flags import get_args_parser

    return {o for action in get_args_parser()._actions for o in action.option_strings if o.startswith("--")}


def names_used_before_introduced() -> list[str]:
    """Walk the main path in order. A name or flag is introduced by a markdown cell that shows it in backticks, or by
    a code cell that defines it (`def`, `class`); a code cell may use a name imported from `tutorial_lib`, or pass a
    `tutorial-train` flag (in a string of a cell that is not exported, docstrings aside), only once it is introduced."""
    flags, introduced, late = tutorial_train_flags(), set(), []
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        from_library: set[str] = set()
        for i, cell in enumerate(cells(path)):
            source = text(cell)
            if cell["cell_type"] == "markdown":
                for span in re.findall(r"`([^`]+)`", source):
                    introduced.update(re.findall(r"--[a-z][a-z0-9_]*|[A-Za-z_][A-Za-z0-9_]*", span))
                continue
            tree = ast.parse(
                "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
            )
            nodes = list(ast.walk(tree))
            docstrings = {
                id(node.body[0].value)
                for node in nodes
                if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef)
                and node.body
                and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
            }
            for node in nodes:
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tutorial_lib"):
                    from_library.update(alias.asname or alias.name for alias in node.names)
                if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
                    introduced.add(node.name)
            used = {n.id for n in nodes if isinstance(n, ast.Name) and n.id in from_library}
            exported = source.startswith("#| export")  # the library's own code: its messages name flags, not use them
            used |= (
                set()
                if exported
                else {
                    flag
                    for n in nodes
                    if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
                    for flag in re.findall(r"--[a-z][a-z0-9_]*", n.value)
                    if flag in flags
                }
            )
            if used - introduced:
                late.append(f"{path.name} cell {i}: {sorted(used - introduced)}")
            introduced |= used
    return late


def test_the_main_path_uses_only_what_it_has_introduced():
    late = names_used_before_introduced()
    assert not late, "used before the main path introduced them (name them in the prose first):\n" + "\n".join(late)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tutorial_lib.cli import format_course_map

    stats = course_stats(NOTEBOOKS)
    print(f"{'notebook':<32} {'words':>6} {'code lines':>10} {'collapsed':>9} {'checks':>6} {'time':>8}")
    for s in stats:
        print(f"{s.name:<32} {s.words:>6} {s.code_lines:>10} {s.collapsed:>9} {s.checks:>6} {s.minutes:>5} min")
    print()
    print(format_course_map(stats))
