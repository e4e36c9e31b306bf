"""The course's command-line conventions (00a): one user-error hierarchy, one `main` convention, one `Progress`."""

import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from train_helpers import exit_status

import tutorial_lib
from tutorial_lib.cli import (
    HelpFormatter,
    OneLineParser,
    Progress,
    as_flags,
    cli_main,
    course_notebooks,
    one_line,
    parse_overrides,
    positive_int,
    run_notebooks,
    stale_outputs,
    user_path,
    wait_to_be_stopped,
)
from tutorial_lib.core import UserError


def library_modules() -> dict:
    """Every module of tutorial_lib, imported."""
    names = [m.name for m in pkgutil.iter_modules(tutorial_lib.__path__) if not m.name.startswith("_")]
    return {name: importlib.import_module(f"tutorial_lib.{name}") for name in names}


# Exceptions of the library that are not an input the user fixes, and why.
NOT_USER_ERRORS = {
    "runs.NonFiniteLossError": "the loss became NaN or Inf: exit status 3, its own line",
    "runs.StopAtOnce": "a second Ctrl-C: a KeyboardInterrupt, exit status 130",
    "decoding._TooManyPixels": "inside decoding only: it becomes the UnreadableImageError that names the file",
}


def test_every_user_error_class_of_the_library_derives_from_core_user_error():
    found = {
        f"{name}.{cls.__name__}": cls
        for name, module in library_modules().items()
        for cls in vars(module).values()
        if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == module.__name__
    }
    assert "core.UserError" in found and len(found) > 8, sorted(found)
    not_user = {name for name, cls in found.items() if not issubclass(cls, UserError)}
    assert not_user == set(NOT_USER_ERRORS), (
        f"an error the user fixes derives from tutorial_lib.core.UserError; any "
        f"other is listed with its reason: {sorted(not_user ^ set(NOT_USER_ERRORS))}"
    )
    assert not [name for name, cls in found.items() if name in NOT_USER_ERRORS and issubclass(cls, UserError)]


def test_the_old_error_families_are_gone():
    modules = library_modules()
    assert not hasattr(modules["accel"], "UserInputError") and not hasattr(modules["train"], "USER_ERRORS")


# Every command line of the course: (module, a bad flag, its error line's start, a wrong input, its line's start).
def command_lines(tmp: Path) -> dict:
    (tmp / "a_file").write_text("")
    return {
        "cli": (
            ["run-notebooks", "--smoke", "--fast"],
            "tutorial-lib: error: unrecognized arguments: --fast",
            ["run-notebooks", str(tmp / "99_missing.ipynb")],
            f"tutorial-lib: error: no notebook {tmp / '99_missing.ipynb'}",
        ),
        "data": (
            ["shard", "a", "b", "--shard_mb", "0"],
            "python -m tutorial_lib.data shard: error: --shard_mb must be",
            ["prepare-val", str(tmp / "nowhere"), str(tmp / "m.txt")],
            f"python -m tutorial_lib.data: error: validation folder {tmp / 'nowhere'} does not exist",
        ),
        "databench": (
            ["--data_dir", "a", "--rounds", "0"],
            "python -m tutorial_lib.databench: error: --rounds must be >= 1",
            ["--data_dir", str(tmp / "nowhere")],
            f"python -m tutorial_lib.databench: error: image folder {tmp / 'nowhere'} does not exist",
        ),
        "bench": (
            ["loop", "--steps", "0"],
            "python -m tutorial_lib.bench loop: error: --steps must be >= 1, got 0",
            ["data", "--data_dir", str(tmp / "nowhere")],
            f"python -m tutorial_lib.bench data: error: image folder {tmp / 'nowhere'} does not exist",
        ),
        "stress": (
            ["resume", "--trials", "0"],
            "python -m tutorial_lib.stress resume: error: --trials must be >= 1",
            ["resume", "--workdir", str(tmp / "a_file")],
            f"python -m tutorial_lib.stress: error: --workdir {tmp / 'a_file'} is a file",
        ),
        "train": (
            ["--epochs", "0"],
            "tutorial-train: error: --epochs must be >= 1, got 0",
            [
                "--cpu",
                "--log_with",
                "none",
                "--path_to_data",
                str(tmp / "nowhere"),
                "--working_directory",
                str(tmp / "runs"),
            ],
            f"tutorial-train: error: --path_to_data: data folder {tmp / 'nowhere'} does not exist",
        ),
        # the one-file script (08) imports nothing of the course, so not cli_main either: the same convention by hand
        "simple_train": (
            ["--path_to_data", str(tmp), "--epochs", "0"],
            "simple_train: error: argument --epochs: expected int in [1, inf], got '0'",
            ["--path_to_data", str(tmp / "nowhere")],
            f"simple_train: error: --path_to_data {tmp / 'nowhere'} needs train/<class>/",
        ),
    }


def test_every_module_with_a_main_is_a_command_line_checked_here(tmp_path):
    with_main = {
        name
        for name, module in library_modules().items()
        if inspect.isfunction(getattr(module, "main", None)) and module.main.__module__ == module.__name__
    }
    assert with_main == set(command_lines(tmp_path)), with_main


@pytest.mark.parametrize("module", ["cli", "data", "databench", "bench", "stress", "train", "simple_train"])
def test_every_command_line_says_a_bad_flag_and_a_wrong_input_in_one_line_with_status_2(
    module, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    bad_flag, flag_line, wrong_input, input_line = command_lines(tmp_path)[module]
    main = importlib.import_module(f"tutorial_lib.{module}").main
    for argv, start in [(bad_flag, flag_line), (wrong_input, input_line)]:
        status = exit_status(main, argv)
        err = capsys.readouterr().err
        assert status == 2 and err.count("\n") == 1 and err.startswith(start), (argv, status, err)
        assert "Traceback" not in err


# Every argument that names a file or folder, by its dest: each must expand `~` through `user_path`, the one place.
PATH_ARGUMENTS = {
    "notebooks", "dest", "val_dir", "mapping", "out", "src", "archive_dir",  # tutorial-lib, the data tools
    "working_directory", "path_to_data", "resume_from_checkpoint", "data_dir", "workdir",  # training, benchmarks
}  # fmt: skip


def library_parsers() -> list:
    """Every parser of the library's command lines (subcommands included); `simple_train` (08) is a standalone
    script that imports nothing of the library, so it has no `user_path` to use."""
    import argparse

    from tutorial_lib import bench, cli, data, databench, flags, stress

    parsers = [m.get_args_parser() for m in (cli, data, databench, bench, stress, flags)]
    for parser in list(parsers):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
    return parsers


def test_every_path_flag_expands_tilde_through_user_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    found = {}
    for parser in library_parsers():
        for action in parser._actions:
            if action.dest in PATH_ARGUMENTS:
                found[f"{parser.prog} {action.dest}"] = action.type
    assert {key.rsplit(" ", 1)[1] for key in found} == PATH_ARGUMENTS, "a path argument no command line has"
    named_like_paths = {
        a.dest for p in library_parsers() for a in p._actions if re.search(r"(dir|path|directory|folder)$", a.dest)
    }
    assert named_like_paths <= PATH_ARGUMENTS, f"path arguments to add to PATH_ARGUMENTS: {named_like_paths}"
    assert {key for key, kind in found.items() if kind is not user_path} == set()
    assert user_path("~/x") == str(tmp_path / "x") and user_path("a/~") == "a/~"


def toy_parser() -> OneLineParser:
    parser = OneLineParser(prog="toy", formatter_class=HelpFormatter)
    parser.add_argument("--n", type=positive_int, default=1)
    return parser


class Shared(UserError):
    """An error every process of a launch meets alike."""


class Nan(RuntimeError):
    """Not the user's input; a status of its own."""


def raises(kind):
    def run(args):
        raise kind("met it")

    return run


def run_toy(run, argv, capsys, **options) -> tuple[int, str, list]:
    seen = []
    status = exit_status(lambda a: cli_main(toy_parser(), run, a, on_exit=seen.append, **options), argv)
    return status, capsys.readouterr().err, seen


def test_cli_main_returns_on_success_and_exits_with_the_status_run_returns(capsys):
    assert run_toy(lambda args: None, [], capsys) == (0, "", [0])
    assert run_toy(lambda args: 143, [], capsys) == (143, "", [143])
    assert run_toy(lambda args: None, ["--help"], capsys)[::2] == (0, [0]), "--help is status 0, and on_exit sees it"


def test_cli_main_says_each_error_once_by_process_0_or_by_the_process_that_met_it_alone(capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    options = dict(shared=(Shared,), exit_statuses={Nan: 3})
    assert run_toy(raises(UserError), [], capsys, **options) == (2, "toy: error: met it\n", [2])
    assert run_toy(raises(Nan), [], capsys, **options) == (3, "toy: error: met it\n", [3])
    assert run_toy(raises(Shared), [], capsys, process=0, **options) == (2, "toy: error: met it\n", [2])
    # a wait of 0.5 s: the calls without one take microseconds, so even a loaded machine keeps them well under it
    quiet = dict(options, process=1, quiet_exit_wait_s=0.5)
    started = time.perf_counter()
    assert run_toy(raises(Shared), [], capsys, **quiet) == (2, "", [2])
    assert time.perf_counter() - started < 0.5, "no launcher started this process, none will stop it: no wait"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a launch")
    started = time.perf_counter()
    assert run_toy(raises(Shared), [], capsys, **quiet) == (2, "", [2])
    assert run_toy(lambda args: None, ["--n", "0"], capsys, **quiet) == (2, "", [2]), "process 0 says a bad flag"
    assert time.perf_counter() - started >= 1.0, "a process that left its error to process 0 exited at once"
    started = time.perf_counter()
    assert run_toy(raises(UserError), [], capsys, **quiet) == (2, "toy: error (process 1): met it\n", [2])
    assert time.perf_counter() - started < 0.5, "a process that said its own error waited"
    assert run_toy(lambda args: None, ["--n", "0"], capsys, **options) == (
        2,
        "toy: error: --n must be >= 1, got 0\n",
        [2],
    )


# Two processes under torchrun's agent (what `accelerate launch` runs), which stops both as soon as one fails:
# process 0 meets the shared error later than process 1 (a slower start, another core's load).
LATE_PROCESS_0 = """
import os, sys, time
sys.path.insert(0, os.environ["TESTS"])
from test_cli import Shared, raises, toy_parser
from tutorial_lib.cli import cli_main
process = int(os.environ["RANK"])
time.sleep(3 if process == 0 else 0)
cli_main(toy_parser(), raises(Shared), [], process=process, shared=(Shared,))
"""


@pytest.mark.slow
def test_an_error_left_to_process_0_is_said_when_process_0_meets_it_after_the_others(tmp_path):
    script = tmp_path / "late_process_0.py"
    script.write_text(LATE_PROCESS_0)
    env = {**os.environ, "TESTS": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0"]
    started = time.perf_counter()
    done = subprocess.run([*command, str(script)], env=env, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    assert done.returncode != 0 and "toy: error: met it\n" in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("toy: error") == 1, done.stderr[-3000:]
    assert seconds < 25, f"the launch took {seconds:.0f} s: the waiting process was not stopped with process 0"


def test_waiting_for_the_launcher_leaves_its_sigterm_deadly_then_puts_the_programs_handler_back(monkeypatch):
    """The training script's late-signal handler finishes its run after a SIGTERM: during the wait it would keep the
    process alive until the launcher's SIGKILL, 30 s later."""

    def finishing(*_):
        pass

    previous = signal.signal(signal.SIGTERM, finishing)
    during = []
    monkeypatch.setattr(time, "sleep", lambda seconds: during.append((seconds, signal.getsignal(signal.SIGTERM))))
    try:
        wait_to_be_stopped(30)
        assert during == [(30, signal.SIG_DFL)] and signal.getsignal(signal.SIGTERM) is finishing
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_cli_main_leaves_a_bug_its_traceback(capsys):
    with pytest.raises(ZeroDivisionError):
        cli_main(toy_parser(), lambda args: 1 / 0, [])
    assert capsys.readouterr().err == ""


@pytest.mark.slow  # a DataLoader worker is a process
def test_one_line_keeps_a_data_loader_workers_original_message():
    from torch.utils.data import DataLoader, Dataset

    class Damaged(Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            raise UserError("cannot decode image 0.jpg:\n  truncated")

    with pytest.raises(UserError) as caught:
        next(iter(DataLoader(Damaged(), num_workers=1)))
    message, line = str(caught.value), one_line(caught.value)
    # The traceback holds the loader's iterator in a reference cycle. Left to the garbage collector, the collection
    # stops the feeder thread of the worker's index queue first: the iterator's shutdown message never reaches the
    # worker, and torch waits out its 5 s join (in whichever test comes next). Dropped here, it goes at once.
    caught.value.__traceback__ = None
    del caught
    assert "Original Traceback" in message and line == "cannot decode image 0.jpg: truncated"


def test_as_flags_writes_the_command_line_that_parse_overrides_parses():
    parser = toy_parser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--milestones", type=positive_int, nargs="*", default=None)
    parser.add_argument("--name", default="a")
    options = dict(n=3, cpu=True, milestones=[30, 60], name=None)
    assert as_flags(options) == ["--n", "3", "--cpu", "--milestones", "30", "60"]
    assert vars(parse_overrides(parser, **options)) == options
    assert as_flags(dict(cpu=False, name=None)) == []


def test_progress_in_a_log_is_one_plain_line_per_interval_in_items_or_bytes():
    log = io.StringIO()
    epoch = Progress(20, "epoch 0", unit="batches", interval=0.0, file=log)
    for _ in range(2):
        epoch.update(10)
    epoch.set_postfix(loss="1.20")
    epoch.update(0)
    epoch.close()  # no summary line unless asked
    lines = log.getvalue().splitlines()
    assert [line.split(", ")[0] for line in lines] == [
        "epoch 0: 10/20 batches (50 %)",
        "epoch 0: 20/20 batches (100 %)",
        "epoch 0: 20/20 batches (100 %)",
    ], lines
    assert lines[-1].endswith(", loss 1.20") and " batches/s, " in lines[0] and "\r" not in log.getvalue()

    log = io.StringIO()
    job = Progress(3_000_000, "job", unit="B", interval=0.0, file=log, summary=True)
    for _ in range(3):
        job.update(1_000_000)
    job.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 4 and lines[0].startswith("job: 1.0 MB of 3.0 MB (33 %)") and "\r" not in log.getvalue()
    assert lines[-1].startswith("job: done, 3.0 MB in")


def test_progress_prints_nothing_when_disabled():
    log = io.StringIO()
    progress = Progress(3, "job", interval=0.0, file=log, disable=True, summary=True)
    progress.update(3)
    progress.close()
    assert log.getvalue() == ""


def test_course_notebooks_sort_each_deep_dive_right_after_its_notebook(tmp_path):
    for name in [
        "10_performance",
        "01_gradient_accumulation",
        "00a_course_tools",
        "00_introduction",
        "08b_production_script",
        "08a_flags_and_checks",
        "08_training_script",
        "scratch",
        "Untitled",
    ]:
        (tmp_path / f"{name}.ipynb").write_text("{}")
    assert [p.stem for p in course_notebooks(tmp_path)] == [
        "00_introduction",
        "00a_course_tools",
        "01_gradient_accumulation",
        "08_training_script",
        "08a_flags_and_checks",
        "08b_production_script",
        "10_performance",
    ]
    course = [p.name for p in course_notebooks(Path(__file__).resolve().parents[1] / "notebooks")]
    assert course[:2] == ["00_introduction.ipynb", "00a_course_tools.ipynb"], course


def test_run_notebooks_refuses_a_missing_notebook_before_running_any(tmp_path):
    with pytest.raises(UserError, match="no notebook .*99_missing.ipynb"):
        run_notebooks([tmp_path / "99_missing.ipynb"], smoke=True)


def notebook(path: Path, source: str, **cell_metadata) -> Path:
    """A one-cell notebook at `path`, with an execution count and cell metadata that nbdev-clean would strip."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(source, execution_count=7, metadata={"scrolled": True, **cell_metadata})
    nb.cells.append(cell)
    nb.metadata["widgets"] = {"state": {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_run_notebooks_cleans_only_the_notebooks_it_was_given(tmp_path):
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "pyproject.toml").write_text((root / "pyproject.toml").read_text())  # nbdev's settings
    one = notebook(tmp_path / "notebooks" / "01_one.ipynb", "print(1 + 1)")
    other = notebook(tmp_path / "notebooks" / "02_learners_own.ipynb", "x = 3", tags=["mine"])
    before = other.read_bytes()
    run_notebooks([one], timeout=120)
    assert other.read_bytes() == before, "a notebook it was not given was rewritten"
    assert '"2\\n"' in one.read_text() and '"scrolled"' not in one.read_text(), "the one given ran and was cleaned"


@pytest.mark.slow
def test_a_failing_cell_names_its_notebook_too(tmp_path):
    from nbclient.exceptions import CellExecutionError

    fine = notebook(tmp_path / "01_fine.ipynb", "print(1)")
    failing = notebook(tmp_path / "02_failing.ipynb", "x = 1 / 0")
    with pytest.raises(CellExecutionError) as failed:
        run_notebooks([fine, failing], smoke=True, timeout=120)
    message = str(failed.value)
    assert message.startswith(f"in {failing}: ") and "x = 1 / 0" in message and "ZeroDivisionError" in message
    assert failed.value.ename == "ZeroDivisionError" and "01_fine" not in message


def test_run_notebooks_refuses_a_file_that_is_not_a_notebook_in_one_line(tmp_path, capsys):
    from tutorial_lib.cli import main

    (tmp_path / "notes.txt").write_text("not a notebook")
    with pytest.raises(SystemExit) as exit_:
        main(["run-notebooks", str(tmp_path / "notes.txt"), "--smoke"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "notes.txt" in err and "not a notebook" in err, err


def test_run_notebooks_refuses_a_read_only_notebook_before_running_any(tmp_path, monkeypatch):
    import os

    import nbclient

    first = notebook(tmp_path / "01_first.ipynb", "print(1)")
    locked = notebook(tmp_path / "02_locked.ipynb", "print(2)")
    locked.chmod(0o444)
    real_access = os.access
    # root may write a file of mode 0444: the check asks os.access, which a read-only file system also answers
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))

    def no_run(*args, **kwargs):
        raise AssertionError("a notebook ran before the read-only one was refused")

    monkeypatch.setattr(nbclient, "NotebookClient", no_run)
    with pytest.raises(UserError, match="02_locked.ipynb"):
        run_notebooks([first, locked])


# ---- committed outputs and the library they were made with ----

ROOT = Path(__file__).resolve().parents[1]
ALL_NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "notebooks/solutions").glob("*.ipynb"))


def test_committed_outputs_made_before_a_change_of_their_modules_are_listed_as_a_warning():
    """Not a failure: a module change must not wait for an hour of full-mode runs; the warning names what to re-run.
    What is asserted: each record names modules that exist, and the list is made for every notebook."""
    stale = stale_outputs(ALL_NOTEBOOKS)
    assert set(stale) <= {str(path) for path in ALL_NOTEBOOKS}
    modules = {path.name for path in (ROOT / "tutorial_lib").glob("*.py")}
    for path in ALL_NOTEBOOKS:
        nb = json.loads(path.read_text())
        record = nb["metadata"].get("tutorial_lib", {}).get("modules")
        assert record is None or (record and set(record) <= modules), (path.name, record)
    changed = {Path(p).relative_to(ROOT / "notebooks").as_posix(): why for p, why in stale.items() if why}
    unrecorded = [p for p, why in stale.items() if why is None]
    if changed:
        warnings.warn(
            f"outputs made before a change of their modules (run again in full mode): {changed}", stacklevel=1
        )
    if unrecorded:
        warnings.warn(
            f"{len(unrecorded)} of {len(ALL_NOTEBOOKS)} notebooks have no record of the modules they ran", stacklevel=1
        )


@pytest.mark.slow
def test_run_notebooks_records_the_modules_a_notebook_ran(tmp_path):
    source = "from tutorial_lib.accumulation import TinyCNN\nprint('ran')"  # accumulation imports core
    nb = {
        "cells": [
            {"cell_type": "code", "execution_count": None, "id": "a", "metadata": {}, "outputs": [], "source": source}
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = tmp_path / "01_x.ipynb"
    path.write_text(json.dumps(nb))
    assert stale_outputs([path]) == {str(path): None}  # no record yet
    run_notebooks([path], clean=False)
    record = json.loads(path.read_text())["metadata"]["tutorial_lib"]["modules"]
    assert {"accumulation.py", "core.py"} <= set(record) and stale_outputs([path]) == {}


def test_stale_outputs_lists_the_solutions_too_skips_notebooks_that_run_no_module_and_refuses_outside_the_project(
    tmp_path, monkeypatch, capsys
):
    from tutorial_lib.cli import main

    plain = tmp_path / "notebooks" / "solutions" / "01_x.ipynb"
    plain.parent.mkdir(parents=True)
    cell = {"cell_type": "code", "execution_count": None, "id": "a", "metadata": {}, "outputs": []}
    nb = {"cells": [{**cell, "source": "print(1)"}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    plain.write_text(json.dumps(nb))
    uses = plain.with_name("02_y.ipynb")
    uses.write_text(json.dumps({**nb, "cells": [{**cell, "source": "import tutorial_lib.core"}]}))
    assert stale_outputs([plain, uses]) == {str(uses): None}, "print(1) runs no module: it cannot go stale"
    monkeypatch.chdir(tmp_path)
    main(["stale-outputs"])
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "notebooks/solutions/02_y.ipynb: no record of its outputs",
        "1 of 2 notebooks to run again (tutorial-lib run-notebooks NOTEBOOK)",
    ], out
    monkeypatch.chdir(tmp_path / "notebooks" / "solutions")  # no notebooks/ here
    with pytest.raises(SystemExit) as exit_:
        main(["stale-outputs"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "tutorial-lib: error: no notebooks/NN_*.ipynb here: run it from the project folder"
    )
