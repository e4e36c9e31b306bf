"""The test session's own safety net: a finished run exits even when a test left something running."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LEFT_BEHIND = """
import threading, time

def test_leaves_a_thread_that_never_ends():
    threading.Thread(target=time.sleep, args=(3600,), name="never-ends").start()  # not a daemon: exit joins it

def test_{outcome}():
    assert {outcome!r} == "passes"
"""


@pytest.mark.slow
@pytest.mark.parametrize("outcome", ["passes", "fails"])
def test_a_thread_left_behind_cannot_hold_the_finished_session(tmp_path, outcome):
    # the project's conftest with a 2 s grace, so the check takes seconds instead of a minute
    conftest = (ROOT / "conftest.py").read_text()
    conftest, count = re.subn(r"^EXIT_GRACE_S = \d+", "EXIT_GRACE_S = 2", conftest, flags=re.M)
    assert count == 1
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_left_behind.py").write_text(LEFT_BEHIND.format(outcome=outcome))
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - start
    assert "still exiting 2 s after its tests ended" in done.stderr
    assert "never-ends" in done.stderr or "Thread 0x" in done.stderr  # the stacks are printed
    # pytest's own status survives: 0 when every test passed, 1 when one failed
    assert done.returncode == (0 if outcome == "passes" else 1), done.stdout + done.stderr
    assert took < 60  # seconds, not the hour the thread would sleep


def collected(*args: str) -> list[str]:
    """The ids `pytest --collect-only` lists for `args` (the project's own settings)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_a_notebook_the_browser_test_runs_is_not_run_by_nbmake_as_well():
    sys.path.insert(0, str(ROOT / "tests"))
    from test_jupyterlab import _missing

    notebook = "notebooks/09_multi_gpu_training.ipynb"
    nbmake_id = f"{notebook}::09_multi_gpu_training.ipynb"
    assert nbmake_id in collected(notebook)  # alone: nbmake runs it
    together = collected(notebook, "tests/test_jupyterlab.py")
    browser = [i for i in together if i.startswith("tests/test_jupyterlab.py::") and "09_multi_gpu" in i]
    assert len(browser) == 1, together
    # with the browser test able to run, it is the one that runs the notebook; without Chromium, nbmake does
    assert (nbmake_id in together) == (_missing() is not None), (together, _missing())
