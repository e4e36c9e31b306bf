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
    shutil.copytree(ROOT / "notebooks", dest / "notebooks",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "*.tmp"))
    shutil.copytree(ROOT / "tutorial_lib", dest / "tutorial_lib",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def modules_out_of_sync(repo_copy: Path) -> list[str]:
    """Export in `repo_copy` and return the generated modules that differ from the committed ones."""
    before = {p.relative_to(repo_copy): p.read_text() for p in (repo_copy / "tutorial_lib").rglob("*.py")}
    subprocess.run([str(NBDEV_EXPORT)], cwd=repo_copy, check=True, capture_output=True, text=True)
    after = {p.relative_to(repo_copy): p.read_text() for p in (repo_copy / "tutorial_lib").rglob("*.py")}
    return sorted(str(p) for p in before.keys() | after.keys() if before.get(p) != after.get(p))


@pytest.mark.slow
def test_exported_modules_match_notebooks(tmp_path):
    changed = modules_out_of_sync(copy_repo(tmp_path))
    assert not changed, (f"tutorial_lib is out of sync with the notebooks: {changed}. "
                         "Edit the notebook, run nbdev-export, and commit both.")


@pytest.mark.slow
def test_sync_check_catches_a_hand_edited_module(tmp_path):
    repo = copy_repo(tmp_path)
    core = repo / "tutorial_lib" / "core.py"
    core.write_text(core.read_text() + "\n# a hand edit that nbdev will overwrite\n")
    assert modules_out_of_sync(repo) == ["tutorial_lib/core.py"]


def test_every_exporting_notebook_owns_one_module():
    owners: dict[str, str] = {}
    for nb_path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(nb_path.read_text())
        targets = {line.split()[-1] for cell in nb["cells"] if cell["cell_type"] == "code"
                   for line in "".join(cell["source"]).splitlines() if line.startswith("#| default_exp")}
        assert len(targets) <= 1, f"{nb_path.name} exports to several modules: {targets}"
        for module in targets:
            assert module not in owners, f"{module} is exported by both {owners[module]} and {nb_path.name}"
            owners[module] = nb_path.name


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


# Words of how this course is made, not of what it teaches: a learner reads every line.
PROCESS_WORDS = re.compile(r"\b(the issue|issues? (asks?|says?)|acceptance|the lead|reviewers?|reviews?|closing note|"
                           r"sessions? (of|time)|tickets?)\b", re.IGNORECASE)


def learner_facing_texts() -> dict[str, str]:
    """Every text a learner reads: notebook cells and their outputs, the README, the library's source."""
    texts = {"README.md": (ROOT / "README.md").read_text()}
    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb_path.read_text())["cells"]):
            outputs = [o.get("text", "") if isinstance(o.get("text", ""), str) else "".join(o["text"])
                       for o in cell.get("outputs", [])]
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
