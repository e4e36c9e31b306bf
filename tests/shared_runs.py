"""Data and a finished run that several test modules use alike (test_reliability, test_reliability_runs), built once
per test session.

Under pytest-xdist every worker is a process of its own: the first one to need a folder builds it in the session's
shared temporary folder behind a file lock, the others wait for it and use it as it is. Tests copy what they change."""

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from train_helpers import CASE_RUN

from tutorial_lib.cli import as_flags
from tutorial_lib.processes import make_image_folder, run_cli


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name` of this test session, made by `build(folder)` by the first worker that asks for it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker has a folder of its own below the session's
    folder, built = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, also if this worker dies
        if not built.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a build that failed left
            build(folder)
            built.touch()
    return folder


def _build_data(folder: Path) -> None:
    make_image_folder(folder, classes=3, train_per_class=8, val_per_class=2)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """3 classes x 8 training and 2 validation JPEGs of 16 px (read only)."""
    return built_once(tmp_path_factory, "small_data", _build_data)


@pytest.fixture
def data(small_data) -> Path:
    """`small_data` under the name the reliability tests give their image folder (a module's own `data` wins)."""
    return small_data


@pytest.fixture(scope="session")
def finished_tiny_run(tmp_path_factory, small_data) -> Path:
    """A completed 2-epoch tinycnn run on `small_data` with a checkpoint every 2 steps (read only: copy it to change
    it): the source of the checkpoint cases, and "run A" of the takeover cases."""

    def train(folder: Path) -> None:
        options = {**CASE_RUN, "epochs": 2, "checkpoint_every_steps": 2, "path_to_data": small_data}
        done = run_cli(as_flags({**options, "working_directory": folder, "experiment_name": "tiny"}))
        assert done.returncode == 0, done.stderr

    return built_once(tmp_path_factory, "finished_tiny_run", train) / "tiny"
