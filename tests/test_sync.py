"""The notebooks are the source of `tutorial_lib`: exporting them must reproduce the committed modules."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NBDEV_EXPORT = Path(sys.executable).with_name("nbdev-export")
NBDEV_CLEAN = Path(sys.executable).with_name("nbdev-clean")


def copy_repo(dest: Path) -> Path:
    """Copy what nbdev needs (config, notebooks, package) into a scratch folder."""
    for name in ["pyproject.toml", "README.md"]:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(
        ROOT / "notebooks", dest / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints", "*.tmp")
    )
    shutil.copytree(ROOT / "tutorial_lib", dest / "tutorial_lib", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def modules_out_of_sync(repo_copy: Path) -> list[str]:
    """Export in `repo_copy` and return the generated modules that differ from the committed ones."""
    before = {p.relative_to(repo_copy): p.read_text() for p in (repo_copy / "tutorial_lib").rglob("*.py")}
    subprocess.run([str(NBDEV_EXPORT)], cwd=repo_copy, check=True, capture_output=True, text=True)
    after = {p.relative_to(repo_copy): p.read_text() for p in (repo_copy / "tutorial_lib").rglob("*.py")}
    return sorted(str(p) for p in before.keys() | after.keys() if before.get(p) != after.get(p))


@pytest.mark.slow
def test_exported_modules_match_notebooks_and_a_hand_edit_is_caught(tmp_path):
    """One export (a few seconds of CPU) shows both: every module is what its notebook exports, and a module edited
    by hand (core.py, in the copy) is found and overwritten."""
    repo = copy_repo(tmp_path)
    core = repo / "tutorial_lib" / "core.py"
    core.write_text(core.read_text() + "\n# a hand edit that nbdev will overwrite\n")
    changed = modules_out_of_sync(repo)
    drift = [m for m in changed if m != "tutorial_lib/core.py"]
    if core.read_text() != (ROOT / "tutorial_lib" / "core.py").read_text():
        drift.append("tutorial_lib/core.py")
    assert not drift, (
        f"tutorial_lib is out of sync with the notebooks: {drift}. "
        "Edit the notebook, run nbdev-export, and commit both."
    )
    assert "tutorial_lib/core.py" in changed, "the hand edit of core.py was not found"


COURSE_NOTEBOOKS = "[0-9][0-9]*_*.ipynb"  # the main path (NN_slug) and the deep dives (NNa_slug), in reading order


def exported_modules(nb_path: Path) -> set[str]:
    """The modules a notebook writes: its `#| default_exp` and any `#| export <module>` cell."""
    nb = json.loads(nb_path.read_text())
    lines = [
        line.split()
        for cell in nb["cells"]
        if cell["cell_type"] == "code"
        for line in "".join(cell["source"]).splitlines()
        if line.startswith("#| ")
    ]
    defaults = [words[-1] for words in lines if words[1] == "default_exp"]
    assert len(defaults) <= 1, f"{nb_path.name} has several default_exp: {defaults}"
    return set(defaults) | {words[2] for words in lines if words[1] in ("export", "exporti") and len(words) > 2}


def module_owners() -> dict[str, str]:
    """Module name -> the notebook that exports it (each module has exactly one)."""
    owners: dict[str, str] = {}
    for nb_path in sorted((ROOT / "notebooks").glob(COURSE_NOTEBOOKS)):
        for module in exported_modules(nb_path):
            assert module not in owners, f"{module} is exported by both {owners[module]} and {nb_path.name}"
            owners[module] = nb_path.name
    return owners


def test_every_module_is_exported_by_exactly_one_notebook():
    owners = module_owners()
    generated = {p.stem for p in (ROOT / "tutorial_lib").glob("*.py") if not p.name.startswith("_")}
    assert generated == set(owners), f"modules without a notebook: {generated - set(owners)}"


def library_imports(module: str) -> set[str]:
    """The `tutorial_lib` modules that `module` imports, at the top or inside a function."""
    import ast

    tree = ast.parse((ROOT / "tutorial_lib" / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .core import x / from . import core
                found |= {node.module} if node.module else {a.name for a in node.names}
            elif node.module and node.module.startswith("tutorial_lib"):
                rest = node.module.split(".")[1:]
                found |= {rest[0]} if rest else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("tutorial_lib.")}
    return found - {module, "__init__", "__version__"}


def test_a_module_imports_only_modules_of_notebooks_that_sort_before_it():
    """Read in order, the course never uses what it has not built yet: a module's notebook sorts after the
    notebooks of every module it imports (00 < 00a < 01 < … < 06 < 06a < 06b < 07 …)."""
    owners = module_owners()
    late = {
        module: sorted(imp for imp in library_imports(module) if imp in owners and owners[imp] >= owners[module])
        for module in owners
    }
    late = {module: imports for module, imports in late.items() if imports}
    assert not late, f"modules importing modules of later (or the same) notebooks: {late}"


def test_the_import_order_check_reads_every_form_of_import(tmp_path, monkeypatch):
    lib = tmp_path / "tutorial_lib"
    lib.mkdir()
    (lib / "m.py").write_text(
        "from .core import a\nfrom . import data\nimport tutorial_lib.train\n"
        "def f():\n    from tutorial_lib.bench import x\n    from tutorial_lib import stress\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert library_imports("m") == {"core", "data", "train", "bench", "stress"}


@pytest.mark.slow
def test_nbdev_clean_leaves_committed_notebooks_unchanged(tmp_path):
    repo = copy_repo(tmp_path)
    notebooks = sorted((repo / "notebooks").glob("*.ipynb"))
    before = {p.name: p.read_text() for p in notebooks}
    subprocess.run([str(NBDEV_CLEAN)], cwd=repo, check=True, capture_output=True, text=True)
    changed = [p.name for p in notebooks if p.read_text() != before[p.name]]
    assert not changed, f"run nbdev-clean and commit: these notebooks carry metadata: {changed}"


@pytest.mark.parametrize("nb_path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_committed_notebook_has_no_error_output_and_the_course_structure(nb_path):
    nb = json.loads(nb_path.read_text())
    errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{nb_path.name} has a committed error output"
    markdown = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert markdown.lstrip().startswith("#") or "\n# " in markdown, f"{nb_path.name} needs a title"
    for heading in ["What you will learn", "## Summary", "## Exercises"]:
        assert heading in markdown, f"{nb_path.name} lacks '{heading}'"
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "assert " in code, f"{nb_path.name} has no check cell asserting its claims"


@pytest.mark.parametrize("nb_path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_committed_outputs_come_from_a_full_mode_run(nb_path):
    """What a learner sees on GitHub is a real run (`tutorial-lib run-notebooks`), never smoke mode's
    shrunken sizes: the setup cell's output says `smoke mode: False`, and no output says otherwise."""
    nb = json.loads(nb_path.read_text())
    texts = ["".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    modes = [line for text in texts for line in text.splitlines() if line.startswith("smoke mode:")]
    assert modes, f"{nb_path.name}: no executed setup cell printing the mode (run `tutorial-lib run-notebooks`)"
    assert all(m.startswith("smoke mode: False") for m in modes), f"{nb_path.name}: outputs from smoke mode: {modes}"


@pytest.mark.parametrize("nb_path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_committed_outputs_hold_each_printed_run_in_one_block(nb_path):
    """A line printed in pieces (text, then newline) by a launched process is one output, not a line followed by an
    empty block: `tutorial-lib run-notebooks` joins consecutive pieces of the same stream."""
    nb = json.loads(nb_path.read_text())
    split = []
    for i, cell in enumerate(nb["cells"]):
        outputs = cell.get("outputs", [])
        for before, after in zip(outputs, outputs[1:]):
            if before.get("output_type") == after.get("output_type") == "stream" and before["name"] == after["name"]:
                split.append(i)
                break
    assert not split, f"{nb_path.name}: cells {split} hold a stream in several outputs (run-notebooks joins them)"


# Words of how this course is made, not of what it teaches: a learner reads every line.
PROCESS_WORDS = re.compile(
    r"\b(the issue|issues? (asks?|says?)|acceptance|the lead|reviewers?|reviews?|closing note|"
    r"sessions? (of|time)|tickets?)\b",
    re.IGNORECASE,
)


def learner_facing_texts() -> dict[str, str]:
    """Every text a learner reads: notebook cells and their outputs, the README, the library's source."""
    texts = {"README.md": (ROOT / "README.md").read_text()}
    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb_path.read_text())["cells"]):
            outputs = [
                o.get("text", "") if isinstance(o.get("text", ""), str) else "".join(o["text"])
                for o in cell.get("outputs", [])
            ]
            texts[f"{nb_path.name} cell {i}"] = "".join(cell["source"]) + "\n" + "\n".join(outputs)
    for module in sorted((ROOT / "tutorial_lib").glob("*.py")):
        if module.name != "_modidx.py":
            texts[f"tutorial_lib/{module.name}"] = module.read_text()
    return texts


def process_words(text: str) -> list[str]:
    return [m.group(0) for m in PROCESS_WORDS.finditer(text)]


def test_the_process_word_check_finds_what_it_should():
    assert process_words("the figures in the note of the issue come from") == ["the issue"]
    assert process_words("as the acceptance runs use, the lead's script") == ["acceptance", "the lead"]
    assert process_words("our target is 1.8x, because a GPU needs many cores") == []


def test_learner_facing_text_never_speaks_of_how_the_course_is_made():
    found = {where: words for where, text in learner_facing_texts().items() if (words := process_words(text))}
    assert not found, f"say it as the course's own goal or reason instead: {found}"


# A bar the course set itself, stated as a bar ("our target is 50 %", "the 2 % goal", "H200 (goal)"), where a
# learner needs the reason for a number or to know it is an estimate; the course's own CI; and test files cited
# as evidence in place of a cell that shows it. A CI job of the learner's is fine, and so is a target accuracy.
BAR_WORDS = re.compile(
    r"\bour\s+(targets?|goals?|bars?)\b|\bgoals?\s+(is|are|was)\b(?:[^.\n]|\n(?!\n)){0,30}?\d"
    r"|\b\d[\d.,]*\s?(%|×|x|img/s)\s(targets?|goals?)\b|(?<![\w.])\((targets?|goals?)\)",
    re.IGNORECASE,
)
CI_WORDS = re.compile(r"\bCI\b(?! jobs?\b)")
TEST_FILE_WORDS = re.compile(
    r"\btests/test_\w+\.py\b|\b(the|our) tests (run|train|compare|check|pin|prove|show)s?\b", re.IGNORECASE
)


def course_voice_words(text: str, readme: bool = False) -> list[str]:
    """Bars of ours, the course's CI and test files cited as evidence; the README's sections for contributors
    (running the test suite, the layout) name the test files and CI legitimately, so there only bars count."""
    patterns = [BAR_WORDS] if readme else [BAR_WORDS, CI_WORDS, TEST_FILE_WORDS]
    return [m.group(0) for pattern in patterns for m in pattern.finditer(text)]


def test_the_course_voice_check_finds_what_it_should_and_leaves_legitimate_uses_alone():
    flagged = [
        "our target is 50 % validation top-1 in under three minutes",
        "Our target for one H200 is 4,000 img/s",
        "The goal is a ratio ≤ 1.02 on CPU",
        "The goal is a ratio\n≤ 1.02",
        "that is within the 2 % goal, up to the noise",
        '("H200 (goal)", "NVIDIA H200", 4_000)',
        "In smoke mode (CPU, CI) the same code runs",
        "The notebook and CI use fork",
        "Tests and CI set it.",
        "`tests/test_parallel.py` runs this comparison",
        "(The tests train from both forms and find bit-identical weights.)",
        "the tests compare the two on the same devkit",
        "Taught in 02, tested in tests/test_parallel.py.",
    ]
    for text in flagged:
        assert course_voice_words(text), text
    legitimate = [
        "the goal of warmup is to let the network settle",
        "the V1 recipe's target of 76.1 % top-1",
        "weight of the uniform distribution in the targets",
        "a link whose target is gone",
        "same recipe, same target",
        "Path(target).write_text(text)",
        "A questionnaire cannot run in a notebook, a CI job or a SLURM script",
        "(a batch job, a CI job, `| tee`)",
        "CIFAR-10 photos",
        "Run the whole test suite",
        "`WANDB_MODE=disabled` (what the tests set)",
        "the real photos committed with the tests",
        "the way the tests do",
        "shuffle=True on the test loader",
        "test-time flips",
    ]
    for text in legitimate:
        assert not course_voice_words(text), (text, course_voice_words(text))
    assert course_voice_words("our target is 2 %; CI runs tests/test_sync.py", readme=True) == ["our target"]


def test_learner_facing_text_sets_no_bar_of_its_own_names_no_ci_and_cites_no_test_file():
    found = {
        where: words
        for where, text in learner_facing_texts().items()
        if (words := course_voice_words(text, readme=where == "README.md"))
    }
    assert not found, (
        "give the reason for a number (or say it is an estimate), and show the evidence in a cell "
        f"instead of citing a test or CI: {found}"
    )
