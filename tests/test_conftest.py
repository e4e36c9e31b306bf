"""The test session's own safety net: a finished run exits even when a test left something running."""

import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tutorial_lib.core

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


@pytest.mark.slow
def test_a_notebook_the_browser_test_runs_is_not_run_by_nbmake_as_well():
    sys.path.insert(0, str(ROOT / "tests"))
    from browser_helpers import browser_missing

    notebook = "notebooks/09_multi_gpu_training.ipynb"
    nbmake_id = f"{notebook}::09_multi_gpu_training.ipynb"
    assert nbmake_id in collected(notebook)  # alone: nbmake runs it
    together = collected(notebook, "tests/test_jupyterlab.py")
    browser = [i for i in together if i.startswith("tests/test_jupyterlab.py::") and "09_multi_gpu" in i]
    assert len(browser) == 1, together
    # with the browser test able to run, it is the one that runs the notebook; without Chromium, nbmake does
    assert (nbmake_id in together) == (browser_missing() is not None), (together, browser_missing())


STARTS_A_PROCESS = """
import subprocess, sys

import pytest

import tutorial_lib.core


def test_unmarked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_marked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_trains():
    import torch
    from accelerate import Accelerator

    Accelerator.backward(None, torch.ones(1, requires_grad=True).sum())  # the call every training loop makes


def test_unmarked_pure_logic():
    assert sorted([2, 1]) == [1, 2]
"""


@pytest.mark.slow
def test_a_test_without_the_slow_mark_that_starts_a_process_or_trains_fails(tmp_path):
    # the project's conftest over four tests: the fast tier refuses exactly the two unmarked ones that start a
    # process or train, with a line that says what to do
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    (tmp_path / "test_tiers.py").write_text(STARTS_A_PROCESS)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rf",
            "--tb=line",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    failed = sorted(re.findall(r"^FAILED \S+::(\w+)", done.stdout, flags=re.M))
    assert failed == ["test_unmarked_starts_a_process", "test_unmarked_trains"], done.stdout[-3000:]
    assert "starts a process but is not marked slow: add @pytest.mark.slow" in done.stdout
    assert "trains (Accelerator.backward) but is not marked slow" in done.stdout
    assert "2 failed, 2 passed" in done.stdout


THREADS_LEFT_BEHIND = """
import torch


def test_sets_two_threads():
    torch.set_num_threads(2)


def test_after_it():
    assert torch.get_num_threads() == 1, torch.get_num_threads()
"""


@pytest.mark.slow
def test_a_thread_count_a_test_sets_does_not_reach_the_next_test(tmp_path):
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    (tmp_path / "test_threads.py").write_text(THREADS_LEFT_BEHIND)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "2 passed" in done.stdout, done.stdout[-3000:]


def code_notebook(*sources: str) -> str:
    """A notebook of code cells, as JSON."""
    cells = [
        {"cell_type": "code", "execution_count": None, "id": f"c{k}", "metadata": {}, "outputs": [], "source": source}
        for k, source in enumerate(sources)
    ]
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return json.dumps({"cells": cells, "metadata": {"kernelspec": kernelspec}, "nbformat": 4, "nbformat_minor": 5})


# Notebook 00 runs the cell that defines (and exports) `scratch_dir` itself: its folders are listed in the notebook's
# own `_scratch_dirs`, not the module's.
SCRATCH_DIR_AS_00_DEFINES_IT = "import atexit, os, shutil, tempfile\nfrom pathlib import Path\n" + re.search(
    r"^_scratch_dirs:.*?(?=^# %%)", inspect.getsource(tutorial_lib.core), re.DOTALL | re.MULTILINE
).group(0)


@pytest.mark.slow
def test_notebooks_share_one_kernel_and_each_starts_as_in_a_fresh_one(tmp_path):
    """A lesson and a solution notebook run in one kernel (the same process), and what the first leaves behind (a
    variable, an environment variable, the working folder, `__spec__` dropped by the reset, a signal handler as
    `notebook_launcher` leaves torch's, a warnings filter, W&B's process-wide settings, a scratch folder's checkpoints)
    does not reach the second;
    a failing cell still fails its notebook, and a notebook that kills its kernel fails alone: the next one gets a
    new kernel. A notebook's scratch folders are deleted when it ends (the tests a worker runs after its last
    notebook do not wait beside its checkpoints), and the kernel exits as a kernel does."""
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    lessons = tmp_path / "notebooks"
    solutions = lessons / "solutions"
    solutions.mkdir(parents=True)
    (lessons / "01_first.ipynb").write_text(
        code_notebook(
            "import os, signal, warnings\nleft = 1\nos.environ['LEFT_BEHIND'] = '1'\nos.chdir('/')\n"
            "signal.signal(signal.SIGTERM, lambda *_: None)\nwarnings.simplefilter('error')\n"
            "import wandb\nwandb.init(mode='disabled').finish()",
            "open(os.path.join(os.environ['PIDS'], 'first'), 'w').write(str(os.getpid()))",
            "from tutorial_lib.core import scratch_dir\nscratch = scratch_dir('left-behind-')\n"
            "(scratch / 'model.safetensors').write_bytes(b'x')\n"
            "open(os.path.join(os.environ['PIDS'], 'scratch'), 'w').write(str(scratch))",
            SCRATCH_DIR_AS_00_DEFINES_IT + "\nscratch = scratch_dir('left-behind-')\n"
            "open(os.path.join(os.environ['PIDS'], 'scratch_00'), 'w').write(str(scratch))",
        )
    )
    (solutions / "02_second.ipynb").write_text(
        code_notebook(
            "import os, multiprocessing, signal, warnings\nfrom pathlib import Path\n"
            "assert 'left' not in globals() and 'LEFT_BEHIND' not in os.environ\n"
            "assert os.getcwd() == os.environ['EXPECT_CWD'] and '__spec__' in globals()\n"
            "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.getsignal(signal.SIGTERM)\n"
            "warnings.warn('a warning is not an error', UserWarning)\n"
            "import wandb\nos.environ['WANDB_MODE'] = 'offline'\nwandb.init(dir=os.environ['PIDS']).finish()\n"
            "assert list(Path(os.environ['PIDS']).glob('wandb/offline-run-*')), 'W&B forgot the first mode'\n"
            "for made_by in 'scratch', 'scratch_00':\n"
            "    scratch = Path(Path(os.environ['PIDS'], made_by).read_text())\n"
            "    assert scratch.name.startswith('left-behind-') and not scratch.exists(), f'{made_by} is left'\n"
            "open(os.path.join(os.environ['PIDS'], 'second'), 'w').write(str(os.getpid()))",
        )
    )
    (solutions / "03_fails.ipynb").write_text(code_notebook("raise ValueError('a failing cell')"))
    (solutions / "04_kills_its_kernel.ipynb").write_text(code_notebook("import os\nos._exit(1)"))
    (solutions / "05_after_a_dead_kernel.ipynb").write_text(
        code_notebook(
            "import os\nfrom tutorial_lib.core import scratch_dir\nscratch = scratch_dir('left-by-the-last-')\n"
            "open(os.path.join(os.environ['PIDS'], 'scratch_last'), 'w').write(str(scratch))"
        )
    )
    (tmp_path / "test_after_the_notebooks.py").write_text(
        "import os\nfrom pathlib import Path\n\n\ndef test_the_last_notebooks_scratch_folder_is_gone():\n"
        "    assert not Path(Path(os.environ['PIDS'], 'scratch_last').read_text()).exists()\n"
    )
    env = {**os.environ, "PIDS": str(tmp_path), "EXPECT_CWD": str(solutions)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--nbmake", "-n", "0"]
        + ["notebooks/01_first.ipynb", "notebooks/solutions", "test_after_the_notebooks.py", "--nbmake-timeout=60"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "2 failed, 4 passed" in done.stdout and "a failing cell" in done.stdout, done.stdout[-3000:]
    assert "FAILED notebooks/solutions/04_kills_its_kernel.ipynb" in done.stdout, "a dead kernel fails its notebook"
    assert (tmp_path / "first").read_text() == (tmp_path / "second").read_text(), "one kernel for both"
    last = Path((tmp_path / "scratch_last").read_text())
    assert last.name.startswith("left-by-the-last-") and not last.exists(), "the last notebook's scratch folder is left"
