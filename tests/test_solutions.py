"""Worked solutions: every course notebook with exercises has a `notebooks/solutions/` notebook, every exercise links
to its solution there, and each solution gives a hint and asserts what it claims in a check cell.

The solution notebooks themselves run under nbmake with the course's notebooks."""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SOLUTIONS = sorted((NOTEBOOKS / "solutions").glob("*.ipynb"))


def cells(path: Path) -> list[dict]:
    return [{**c, "text": "".join(c["source"])} for c in json.loads(path.read_text())["cells"]]


def exercises(path: Path) -> list[str]:
    """The numbered items of a course notebook's "## Exercises" section."""
    for cell in cells(path):
        if cell["cell_type"] == "markdown" and "## Exercises" in cell["text"]:
            block = cell["text"].split("## Exercises", 1)[1]
            return [item for item in re.split(r"^(?=\d+\. )", block, flags=re.M) if re.match(r"\d+\. ", item)]
    return []


def solution_sections(path: Path) -> list[list[dict]]:
    """The cells of each "## Exercise k" section of a solutions notebook, in order."""
    sections: list[list[dict]] = []
    for cell in cells(path):
        if cell["cell_type"] == "markdown" and re.match(r"## Exercise \d+\b", cell["text"]):
            number = int(re.match(r"## Exercise (\d+)", cell["text"]).group(1))
            assert number == len(sections) + 1, f"{path.name}: exercise {number} out of order"
            sections.append([])
        if sections:
            sections[-1].append(cell)
    return sections


def test_there_are_solution_notebooks_and_each_answers_a_course_notebook():
    assert SOLUTIONS, "no notebooks/solutions/*.ipynb"
    for solution in SOLUTIONS:
        assert (NOTEBOOKS / solution.name).is_file(), f"{solution.name} answers no course notebook"


def test_every_course_notebook_with_exercises_has_its_solutions_notebook():
    with_exercises = [path.name for path in sorted(NOTEBOOKS.glob("*.ipynb")) if exercises(path)]
    assert with_exercises, "no course notebook has an Exercises section"
    missing = [name for name in with_exercises if not (NOTEBOOKS / "solutions" / name).is_file()]
    assert not missing, f"exercises without a solutions notebook: {missing}"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_every_exercise_has_one_linked_solution_with_a_hint_and_a_check(solution):
    asked = exercises(NOTEBOOKS / solution.name)
    answered = solution_sections(solution)
    assert len(asked) == len(answered) > 0, f"{len(asked)} exercises, {len(answered)} solutions"
    for k, (exercise, section) in enumerate(zip(asked, answered), start=1):
        assert f"(solutions/{solution.name}#Exercise-{k})" in exercise, f"exercise {k} does not link its solution"
        assert "**Hint:**" in section[0]["text"], f"solution {k} has no hint"
        checks = [
            c for c in section if c["cell_type"] == "code" and "assert " in c["text"] and "check passed" in c["text"]
        ]
        assert checks, f"solution {k} has no check cell (an assert and a 'check passed' line)"
