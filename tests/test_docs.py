"""The README as a front door and the guides in docs/: short, true to the notebooks, and in the course's voice.

The README holds what a learner needs first (what the course is, the install, the quick start, the course map,
the ImageNet commands, where to look when stuck); the reference lives in docs/*.md, the contributor's material in
CONTRIBUTING.md. These checks read the files only: the README's install is resolved from pyproject.toml and the
installed packages' metadata, not run."""

import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from test_course import MACHINE_PATHS
from test_sync import BAR_WORDS, PROCESS_WORDS, course_voice_words

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
GUIDES = ["docs/imagenet.md", "docs/preemption.md", "docs/speed.md"]  # the reference moved out of the README
README_WORDS = 1_300  # `wc -w`: a page a learner reads in about five minutes

# Words of how the course is made and checked, which a learner has no use for. The README's last section sends a
# contributor to CONTRIBUTING.md in one line and is the only place in README and docs/ allowed to use them.
MACHINERY_WORDS = re.compile(
    r"(?-i:\bCI\b)|\bpytest\b|\bcommit(s|ted|ting)?\b|\bissues?\b|\btest suite\b", re.IGNORECASE
)
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")  # a number needs a source
CONTRIBUTING_SECTION = "## Contributing"


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def readme_for_learners() -> str:
    """The README without its last section, the one line for contributors."""
    text = README.read_text()
    assert text.count(CONTRIBUTING_SECTION) == 1, f"the README needs one {CONTRIBUTING_SECTION!r} section"
    head, _, contributing = text.partition(CONTRIBUTING_SECTION)
    assert "](CONTRIBUTING.md)" in contributing and contributing.count("\n## ") == 0, (
        "the README's contributing section is its last, and links CONTRIBUTING.md"
    )
    assert len(contributing.split()) <= 40, "one line for contributors: the rest belongs in CONTRIBUTING.md"
    return head


def learner_pages() -> dict[str, str]:
    return {"README.md": readme_for_learners(), **{f"docs/{p.name}": p.read_text() for p in DOCS}}


def test_readme_fits_in_1300_words():
    words = len(README.read_text().split())
    assert words <= README_WORDS, f"README.md has {words} words (wc -w); move reference text to docs/"


def test_readme_and_docs_speak_to_learners_only():
    found = {}
    for where, text in learner_pages().items():
        words = [m.group(0) for m in MACHINERY_WORDS.finditer(text)]
        words += [m.group(0) for m in PROCESS_WORDS.finditer(text)]
        words += course_voice_words(text)  # bars of ours, the course's CI, test files cited as evidence
        if words:
            found[where] = words
    assert not found, f"words of the course's machinery (they belong in CONTRIBUTING.md): {found}"


def test_contributing_sets_no_bar_and_speaks_of_no_process():
    text = CONTRIBUTING.read_text()
    words = [m.group(0) for pattern in (BAR_WORDS, PROCESS_WORDS) for m in pattern.finditer(text)]
    assert not words, f"CONTRIBUTING.md: give the reason for a number, in the course's own words: {words}"


def test_no_machine_path_and_no_commit_hash_in_readme_docs_or_contributing():
    pages = {"README.md": README.read_text(), "CONTRIBUTING.md": CONTRIBUTING.read_text()}
    pages |= {f"docs/{p.name}": p.read_text() for p in DOCS}
    found = {
        where: [m.group(0) for pattern in (MACHINE_PATHS, COMMIT_HASH) for m in pattern.finditer(text)]
        for where, text in pages.items()
    }
    found = {where: hits for where, hits in found.items() if hits}
    assert not found, f"a path of this machine, or a commit hash where a number needs its source: {found}"


def test_the_machinery_check_finds_what_it_should():
    flagged = ["run pytest", "CI runs it", "commit both", "as committed", "an issue", "the test suite takes"]
    assert all(MACHINERY_WORDS.search(t) for t in flagged), [t for t in flagged if not MACHINERY_WORDS.search(t)]
    legitimate = ["CIFAR-10", "`.ci/gpu`", "committee", "tissue", "tested on a CPU", "the tests/ folder"]
    assert not [t for t in legitimate if MACHINERY_WORDS.search(t)]
    assert COMMIT_HASH.search("at 66809af") and COMMIT_HASH.search("commit da2ef9f")
    assert not COMMIT_HASH.search("decade") and not COMMIT_HASH.search("1234567")


def test_guides_named_in_the_readme_exist_and_every_guide_is_named():
    readme = README.read_text()
    named = set(re.findall(r"\]\((docs/[^)#\s]+)", readme))
    assert set(GUIDES) <= named, f"the README must link every guide: {sorted(set(GUIDES) - named)}"
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"the README links guides that do not exist: {missing}"
    absent = sorted(set(GUIDES) - {f"docs/{p.name}" for p in DOCS})
    assert not absent, f"guides missing from docs/: {absent}"
    assert (ROOT / "CONTRIBUTING.md").is_file() and "](CONTRIBUTING.md)" in readme


def test_readme_and_contributing_give_the_test_command_ci_runs():
    """`.ci/run` runs exactly the test command that the README's last line and CONTRIBUTING.md give."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    command = next(line for line in reversed(ci) if line.startswith("python -m pytest"))
    readme_line = " ".join(README.read_text().partition(CONTRIBUTING_SECTION)[2].split())
    assert f"&& {command}`" in readme_line, (command, readme_line)
    assert f"&& {command}\n" in CONTRIBUTING.read_text(), command


def test_readme_names_the_websites_build_and_serve_commands():
    readme = readme_for_learners()
    assert "mkdocs build --strict" in readme and "mkdocs serve" in readme and "site/" in readme


# ---- the install ----


def readme_install_extras() -> set[str]:
    """The extras of the README's `pip install -e ".[...]"` in its Install section."""
    readme = README.read_text()
    install = readme[readme.index("## Install") :]
    install = install[: install.index("\n## ")]
    found = re.findall(r'pip install -e "\.\[([\w,-]+)\]"', install)
    assert len(found) == 1, f'the Install section should hold one `pip install -e ".[extra]"`: {found}'
    return set(found[0].split(","))


def project_requirements(extras: set[str]) -> list[Requirement]:
    """The project's dependencies plus those of `extras`, read from pyproject.toml (self-references expanded)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = extras - optional.keys()
    assert not unknown, f"the README installs extras that pyproject.toml does not define: {unknown}"
    reqs, todo, done = [Requirement(r) for r in project["dependencies"]], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for line in optional[extra]:
            req = Requirement(line)
            if normalized(req.name) == normalized(project["name"]):
                todo += list(req.extras)
            else:
                reqs.append(req)
    return reqs


def installed_closure(reqs: list[Requirement]) -> set[str]:
    """Every distribution these requirements bring, walked through the installed packages' metadata."""
    seen, todo = set(), [(r, set(r.extras)) for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        req, extras = todo.pop()
        key = normalized(req.name)
        if (key, frozenset(extras)) in seen:
            continue
        seen.add((key, frozenset(extras)))
        try:
            requires = distribution(req.name).requires or []
        except PackageNotFoundError:
            continue
        for line in requires:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((sub, set(sub.extras)))
    return {key for key, _ in seen}


def notebook_imports() -> dict[str, set[str]]:
    """Top-level modules imported by the course's notebooks and solutions -> the notebooks that import them."""
    imports: dict[str, set[str]] = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "notebooks/solutions").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                for module in re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", "".join(cell["source"]), re.M):
                    imports.setdefault(module, set()).add(path.name)
    return imports


def test_readme_install_extra_holds_jupyterlab_and_its_kernel():
    names = {normalized(r.name) for r in project_requirements(readme_install_extras())}
    assert {"jupyterlab", "ipykernel", "ipywidgets"} <= names, f"the README's install lacks JupyterLab: {names}"


def test_readme_install_extra_brings_every_package_a_notebook_imports():
    """Resolved with this environment's installed metadata (the install itself is not run here): every
    third-party module a notebook or solution imports belongs to a distribution the README's install brings."""
    reqs = project_requirements(readme_install_extras())
    brought = installed_closure(reqs) | {"tutorial-lib"}
    owners = packages_distributions()
    missing, resolved = {}, set()
    for module, where in notebook_imports().items():
        for dist in owners.get(module, []):  # a module no installed distribution owns: the notebook wrote it
            resolved.add(module)
            if normalized(dist) not in brought:
                missing[module] = (dist, sorted(where)[:3])
    assert {"torch", "IPython", "matplotlib", "datasets", "psutil", "yaml"} <= resolved, resolved
    assert not missing, f"the README's install does not bring what these notebooks import: {missing}"


@pytest.mark.slow
def test_readme_install_resolves_offline_against_this_environment():
    """pip resolves the README's `pip install -e ".[extra]"` from what is installed here, without an index: every
    requirement of the extra exists and is satisfied (a dry run: nothing is installed)."""
    extras = ",".join(sorted(readme_install_extras()))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index", "--no-build-isolation"]
        + ["-e", f".[{extras}]"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]


# How a teacher checks that a notebook runs, in smoke mode (the root conftest.py sets it): nbmake under pytest, with
# the project's own options, which need the contributors' plugins, left out.
NOTEBOOK_CHECK = ["pytest", "--nbmake", "-o", "addopts=", "notebooks/00_introduction.ipynb"]


def test_readme_install_brings_what_a_teachers_notebook_check_runs():
    brought = installed_closure(project_requirements(readme_install_extras()))
    assert {"pytest", "nbmake", "jupyterlab"} <= brought, sorted(brought)


@pytest.mark.slow
def test_readme_notebook_check_needs_none_of_the_contributors_plugins():
    """A teacher's smoke-mode run of notebook 00 after the README's install, collected with the plugins only the
    `dev` extra installs switched off (xdist, timeout): its options are understood and it finds the notebook. (The
    run itself is the suite's own smoke run of 00.)"""
    command = NOTEBOOK_CHECK
    result = subprocess.run(
        [sys.executable, "-m", *command[:-1], "-p", "no:xdist", "-p", "no:timeout", "--collect-only", "-q"]
        + [command[-1]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "1 test collected" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]


def test_dev_extra_holds_everything_the_course_extra_does():
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dev = {normalized(Requirement(r).name) for r in optional["dev"]}
    course = {normalized(Requirement(r).name) for r in optional["course"]}
    assert course <= dev, f"a contributor's install lacks what a learner's has: {sorted(course - dev)}"


# ---- the course map ----


def stated_title_and_minutes(path: Path) -> tuple[str, int]:
    """A notebook's title (`# NN · ...`) and the time stated under it (`*About N minutes ...*`)."""
    head = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"][:3])
    title = re.search(r"^# (.+)$", head, re.M)
    minutes = re.search(r"^\*About (\d+) minutes", head, re.M)
    assert title and minutes, f"{path.name}: no title or stated time"
    return title.group(1).strip(), int(minutes.group(1))


def expected_course_map() -> list[str]:
    """The README's course map, one line per notebook, deep dives indented under their chapter; a title is cut
    at its first colon."""
    lines = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb")):
        title, minutes = stated_title_and_minutes(path)
        indent = "" if path.name[2] == "_" else "    "  # four spaces: a nested list in MkDocs too
        lines.append(f"{indent}- [{title.split(':')[0].strip()}](notebooks/{path.name}) ({minutes} min)")
    return lines


def test_readme_course_map_matches_every_notebooks_title_and_stated_time():
    expected = expected_course_map()
    pattern = re.compile(r"^ *- \[\d\d[a-z]? · .*\]\(notebooks/[^)]+\.ipynb\) \(\d+ min\)$", re.M)
    actual = pattern.findall(README.read_text())
    assert actual == expected, "the README's course map differs from the notebooks; it should read:\n" + "\n".join(
        expected
    )


# ---- figures the guides quote from notebooks' outputs ----

# (page, notebook, what the page says, what the notebook's outputs or prose say): a figure moves with its source.
QUOTED_FIGURES = [
    ("README.md", "08b_production_script.ipynb", "ended at 50.1 % validation top-1", "best val top-1 50.10%"),
    ("README.md", "08b_production_script.ipynb", "the same recipe in 135 s", "| 135 s |"),
    ("docs/imagenet.md", "07e_data_benchmarks.ipynb", "685 images/s", "pipeline   685, decode only   858"),
    ("docs/imagenet.md", "07e_data_benchmarks.ipynb", "0.80 of the 858 images/s", "0.80 of its own limit"),
    ("docs/imagenet.md", "07e_data_benchmarks.ipynb", "80 % of its time", "decoding is 80%"),
    ("docs/imagenet.md", "07e_data_benchmarks.ipynb", "flip 10.6 %", "crop, resize, flip      154 µs  10.6%"),
    ("docs/imagenet.md", "07e_data_benchmarks.ipynb", "720 from shards", "pipeline   720"),
    ("docs/imagenet.md", "07e_data_benchmarks.ipynb", "only 11 of those 100", "11 of 100 photos are longer"),
    ("docs/imagenet.md", "07e_data_benchmarks.ipynb", "1,653 from shards", "pipeline  1653"),
    ("docs/imagenet.md", "07e_data_benchmarks.ipynb", "1.93 × the originals'", "1.93 of the originals'"),
    ("docs/imagenet.md", "07d_datasets.ipynb", "about 15 MB", "| 14 MB | 15 MB |"),
    ("docs/imagenet.md", "07d_datasets.ipynb", "376 MB", "| 303 MB | 376 MB |"),
    ("docs/imagenet.md", "07d_datasets.ipynb", "312 MB", "| 240 MB | 312 MB |"),
    ("docs/imagenet.md", "07d_datasets.ipynb", "3 to 5 s", "scanned the tree in 3 to 5 s"),
    ("docs/speed.md", "10a_benchmarks.ipynb", "1.003, 95 % interval [0.998, 1.011] over 32 rounds", None),
    ("docs/speed.md", "10a_benchmarks.ipynb", "1.000 in [0.993, 1.012]", None),
    ("docs/speed.md", "10a_benchmarks.ipynb", "up to 1.2 %", "noise reaches 1.2%"),
    ("docs/speed.md", "10a_benchmarks.ipynb", "at most 1.1 % more", "at most 1.1% more than a bare loop"),
    ("docs/speed.md", "07e_data_benchmarks.ipynb", "2.05× (train) and 2.64× (val)", "2.05× (2.05×)"),
    ("docs/speed.md", "07e_data_benchmarks.ipynb", "5 ImageNet photos repeated 20 times", "5 images × 20 from"),
    ("docs/speed.md", "10_performance.ipynb", "71 at 160 px and 17 at 192 px", "71 at 160 px, 17 at 192 px"),
    ("docs/speed.md", "10_performance.ipynb", "75% of 88 epochs at 192 px (25% fewer FLOPs)", None),
]


def notebook_text(name: str) -> str:
    """A notebook's sources and text outputs, as a learner sees them."""
    parts = []
    for cell in json.loads((ROOT / "notebooks" / name).read_text())["cells"]:
        parts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            text = output.get("text", "")
            parts.append(text if isinstance(text, str) else "".join(text))
    return "\n".join(parts)


def test_figures_the_guides_quote_are_those_of_the_notebooks_they_cite():
    stale = []
    for page, notebook, in_page, in_notebook in QUOTED_FIGURES:
        page_text = " ".join((ROOT / page).read_text().split())  # line breaks do not matter
        if in_page not in page_text:
            stale.append(f"{page} no longer says {in_page!r}: update this table with the page")
        if (in_notebook or in_page) not in notebook_text(notebook):
            stale.append(f"{notebook} no longer shows {in_notebook or in_page!r}: update {page} from its output")
    assert not stale, "\n".join(stale)
