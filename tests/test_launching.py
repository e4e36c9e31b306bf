"""tutorial_lib.launching: `launch_with_timeout` gives up after its last attempt and runs each process on one thread.
(That a hung launch is killed after its timeout and started again, with no worker left: 06c's check.)

The launched functions live at module level so that they can be pickled."""

import json
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from tutorial_lib.launching import hosted_runtime, launch_records, launch_runs_in_kernel, launch_with_timeout, report


def hang_once_on_rank_1(marker: str) -> None:
    """A launched function whose first launch hangs on rank 1 (as a worker that inherited a held lock does)."""
    import time

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    first_launch = not Path(marker).exists()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        Path(marker).write_text(Path(marker).read_text() + "x" if Path(marker).exists() else "x")
    if first_launch and accelerator.process_index == 1:
        time.sleep(600)
    accelerator.wait_for_everyone()
    Path(f"{marker}.done{accelerator.process_index}").write_text(str(accelerator.num_processes))


@pytest.mark.slow
def test_launch_with_timeout_gives_up_after_its_attempts(tmp_path):
    marker = str(tmp_path / "launches")
    with pytest.raises(ChildFailedError):
        launch_with_timeout(hang_once_on_rank_1, (marker,), num_processes=2, timeout=10, attempts=1)
    assert Path(marker).read_text() == "x"


def note_threads(out: str) -> None:
    """A launched function that notes its OMP_NUM_THREADS and torch thread count, per rank."""
    import warnings

    from accelerate import Accelerator

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(cpu=True)
    Path(f"{out}.{accelerator.process_index}").write_text(
        json.dumps([os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads(), [str(w.message) for w in caught]])
    )


@pytest.mark.slow
def test_launched_processes_compute_on_one_thread_without_accelerates_warning(tmp_path, monkeypatch, capsys):
    """Forked from a process that has computed with OpenMP threads, a worker's first multi-threaded operation
    hangs (GCC's libgomp after fork): each launched process runs on one thread unless OMP_NUM_THREADS says
    otherwise, set in torch itself (a forked process keeps its parent's count whatever the variable says)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    torch.ones(512, 512) @ torch.ones(512, 512)  # this process has now used its OpenMP threads
    out = str(tmp_path / "threads")
    launch_with_timeout(note_threads, (out,), num_processes=2, timeout=120)
    for rank in (0, 1):
        variable, threads, warned = json.loads(Path(f"{out}.{rank}").read_text())
        assert (variable, threads) == ("1", 1)
        assert not any("OMP_NUM_THREADS" in w for w in warned), warned
    assert "OMP_NUM_THREADS" not in os.environ, "the launching process's environment is restored"
    assert "Launching training on" not in capsys.readouterr().out, "no 'N CUDAs' banner on a CPU"


# ---- hosted notebooks -----------------------------------------------------------------------------


class FakeShell:
    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return f"<{self.name} object at 0x7f>"


@pytest.mark.parametrize(
    "environ, shell, expected",
    [
        ({}, None, None),  # a script
        ({"HOME": "/home/me"}, "ipykernel.zmqshell.ZMQInteractiveShell", None),  # JupyterLab on a laptop
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "ipykernel.zmqshell.ZMQInteractiveShell", "kaggle"),
        ({}, "google.colab._shell.Shell", "colab"),  # a Colab kernel
        # a script started from a Colab kernel: Colab's variables, no Colab shell; notebook_launcher launches for real
        ({"COLAB_RELEASE_TAG": "release-colab_20261120"}, None, None),
    ],
)
def test_hosted_runtime_is_recognised_from_the_signs_notebook_launcher_reads(monkeypatch, environ, shell, expected):
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: FakeShell(shell) if shell else None)
    assert hosted_runtime(environ) == expected


def test_only_colab_with_fewer_than_two_gpus_keeps_a_launch_in_the_kernel():
    assert launch_runs_in_kernel(2, runtime="colab", gpus=1) and launch_runs_in_kernel(2, runtime="colab", gpus=0)
    assert not launch_runs_in_kernel(2, runtime="colab", gpus=2)
    assert not launch_runs_in_kernel(2, runtime="kaggle", gpus=2), "Kaggle's 2 x T4 launches 2 processes"
    assert not launch_runs_in_kernel(2, runtime=None, gpus=0), "a laptop launches CPU processes"
    assert not launch_runs_in_kernel(1, runtime="colab", gpus=1), "one process asked, one process run: nothing to say"


def note_world_size(out_dir: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    report(accelerator, out_dir, world_size=accelerator.num_processes, pid=os.getpid())


@pytest.mark.slow
def test_a_script_started_from_colab_launches_its_processes_as_notebook_launcher_does(monkeypatch, capsys, tmp_path):
    # Colab's variables reach a script its kernel starts, but not its IPython shell, which is what notebook_launcher
    # reads: two processes really start, so no in-kernel note is printed and each process reports a world size of 2
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20261120-060000_RC00")
    records = launch_records(note_world_size, num_processes=2, folder=tmp_path, timeout=120)
    assert "note: on Colab" not in capsys.readouterr().out
    assert [r["world_size"] for r in records] == [2, 2] and os.getpid() not in {r["pid"] for r in records}, records


def test_a_launch_that_colab_keeps_in_the_kernel_is_said_before_it_runs(monkeypatch, capsys, tmp_path):
    import IPython
    from accelerate.state import AcceleratorState

    monkeypatch.setattr(IPython, "get_ipython", lambda: FakeShell("google.colab._shell.Shell"))
    try:
        records = launch_records(note_world_size, num_processes=2, folder=tmp_path, timeout=60)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    out = capsys.readouterr().out
    assert out.startswith("note: on Colab with fewer than 2 GPUs, notebook_launcher runs the function once"), out
    assert records == [{"world_size": 1, "pid": os.getpid()}], "accelerate really ran it here, as one process"
