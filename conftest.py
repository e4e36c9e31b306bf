"""Test-session settings shared by unit tests and notebooks (nbmake kernels inherit this env)."""

import os

# Notebooks and tests run in smoke mode: same code path, small sizes.
os.environ.setdefault("TUTORIAL_SMOKE", "1")
# Never block on W&B credentials or the network in tests.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
# Headless plotting.
os.environ.setdefault("MPLBACKEND", "Agg")
# Two cores: keep each process (and each xdist worker) from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import faulthandler
import sys
import threading
import time

import pytest

# Seconds a test process may spend exiting once its tests are done (normally well under one).
EXIT_GRACE_S = 60


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Reset accelerate's process-wide singletons after every test.

    `Accelerator()` stores its state (device, world size) in singletons that outlive it. A test that
    builds one leaves a 1-process state behind in the pytest worker; processes that a later test
    forks with `debug_launcher` would inherit it and run unconnected instead of as a 2-process group."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


@pytest.fixture(autouse=True)
def one_thread_again():
    """Put torch back on the session's thread count after every test.

    A test that sets another count (to check what a launch does after a multi-threaded parent) would leave it to
    every later test of its xdist worker: an in-process training run then computes on 2 threads beside the other
    worker, on 2 cores, and took three times as long in a measured run of the suite."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != int(os.environ.get("OMP_NUM_THREADS", "1")):
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


class FastTierViolation(Exception):
    """A test without the `slow` mark started a process or trained: the fast tier (`-m "not slow"`) promised not to."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """In a test without the `slow` mark, starting a process (`subprocess`, `multiprocessing`, hence also accelerate's
    launchers) or a training step (`Accelerator.backward`, which every training loop of the course calls) raises
    `FastTierViolation`: mark the test `slow`. Its fixtures are watched too (set-up and teardown are part of the
    protocol), so a module fixture that launches processes counts for the unmarked test that needs it. This keeps
    `pytest -m "not slow"` the minute it promises."""
    if item.get_closest_marker("slow") or item.nodeid.split("::")[0].endswith(".ipynb"):
        yield
        return
    import multiprocessing.process
    import subprocess
    from unittest import mock

    from accelerate import Accelerator  # first, unwatched: importing torch runs `ldconfig` once per process

    def refuse(what):
        def refused(*args, **kwargs):
            raise FastTierViolation(f"{item.nodeid} {what} but is not marked slow: add @pytest.mark.slow")

        return refused

    with (
        mock.patch.object(subprocess.Popen, "__init__", refuse("starts a process")),
        mock.patch.object(multiprocessing.process.BaseProcess, "start", refuse("starts a process")),
        mock.patch.object(Accelerator, "backward", refuse("trains (Accelerator.backward)")),
    ):
        yield


def pytest_addoption(parser):
    parser.addoption(
        "--full-matrix",
        action="store_true",
        help="also run the further combinations of the launcher, signal and thread-count matrices "
        "(tests marked full_matrix; about 2.5 more minutes on 2 cores)",
    )


def pytest_collection_modifyitems(config, items):
    """Notebooks train and launch processes: they are `slow` too (`pytest -m "not slow"` is the fast inner loop).

    A matrix (launcher x signal, thread counts) runs one representative point of each claim by default; its other
    combinations are marked `full_matrix` and run with `--full-matrix`; without it they are reported as skipped."""
    full = config.getoption("--full-matrix")
    skip = pytest.mark.skip(reason="a further combination of a test matrix: run with --full-matrix")
    for item in items:
        if item.nodeid.endswith(".ipynb") or ".ipynb::" in item.nodeid:
            item.add_marker(pytest.mark.slow)
        if "full_matrix" in item.keywords and not full:
            item.add_marker(skip)


class NotebooksRunInTheBrowser:
    """A notebook that the browser test runs through JupyterLab (tests/test_jupyterlab.py) is not run by nbmake too.

    Both run every cell in smoke mode in a kernel and fail on any error; the browser also checks what the page shows.
    Where that test cannot run (no Chromium), or is not chosen, nbmake runs the notebook as it runs the others."""

    @pytest.hookimpl(trylast=True)  # after `-m`, `-k` and the paths have chosen the items
    def pytest_collection_modifyitems(self, config, items):
        in_browser = {
            f"notebooks/{item.callspec.params['name']}::{item.callspec.params['name']}"  # nbmake's id of the notebook
            for item in items
            if item.nodeid.startswith("tests/test_jupyterlab.py::")
            and not any(mark.args and mark.args[0] for mark in item.iter_markers("skipif"))
        }
        twice = [item for item in items if item.nodeid in in_browser]
        if twice:
            config.hook.pytest_deselected(items=twice)
            items[:] = [item for item in items if item.nodeid not in in_browser]


# Where notebooks share one kernel per test process instead of starting their own: all of them. A kernel's start
# (ipykernel, torch, torchvision and the library imported) costs about 3 CPU-s on a 2-core VM, the whole cost of the
# shortest notebooks, saved for each of the 58 but the first of each worker. Each notebook still starts as in a
# fresh kernel: `RESET_KERNEL` puts back what one may leave behind, and tests/test_conftest.py checks it.
SHARED_KERNEL_FOLDERS = ("notebooks",)
# Except these, which keep nbmake's fresh kernel. 07d's check measures how much a loader worker, forked from the
# kernel, copies while it reads: the interpreter's own share of that grows with the kernel's heap, which in a shared
# kernel holds what every earlier notebook imported (3.3 MB in a fresh kernel in full mode, 4.0 to 5.0 MB in the
# shared one in smoke mode, against the check's 5 MB).
OWN_KERNEL_NOTEBOOKS = ("notebooks/07d_datasets.ipynb",)

# Run in the shared kernel before each notebook: what one notebook may leave behind, put back as the kernel started.
# The namespace is emptied (`%reset -f`), so a notebook that forgets an import still fails; imported modules stay
# loaded, which is the point.
RESET_KERNEL = """
def _capture():
    import os, signal, sys, types, warnings
    if "_shared_kernel_state" in sys.modules:
        return
    import torch
    state = sys.modules["_shared_kernel_state"] = types.ModuleType("_shared_kernel_state")
    main = sys.modules["__main__"]
    environ, path, threads = dict(os.environ), list(sys.path), torch.get_num_threads()
    # launchers install their own handlers (torch's `_terminate_process_handler`) and may leave them behind
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}
    warning_filters = list(warnings.filters)
    dunders = {k: v for k, v in vars(main).items() if k.startswith("__") and k.endswith("__")}

    def restore(folder):
        vars(main).update(dunders)  # `%reset` also drops `__spec__`, which multiprocessing reads
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        os.chdir(folder)
        torch.set_num_threads(threads)
        torch._dynamo.reset()  # compiled graphs and the shapes it has seen: what a notebook's compiles depend on
        for number, handler in handlers.items():
            signal.signal(number, handler)
        warnings.filters[:] = warning_filters
        warnings._filters_mutated()  # the module caches its filters per call site
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
        if "accelerate.state" in sys.modules:  # a run's Accelerator: notebook_launcher refuses a kernel that holds one
            sys.modules["accelerate.state"].AcceleratorState._reset_state(reset_partial_state=True)
            sys.modules["accelerate.state"].GradientState._reset_state()
        if "wandb" in sys.modules:  # its process-wide settings keep the first run's mode (disabled, offline, ...)
            sys.modules["wandb"].teardown()
        if "tutorial_lib.processes" in sys.modules:  # its fork server imported the previous notebook's environment
            sys.modules["tutorial_lib.processes"].stop_fork_server()
            sys.modules["tutorial_lib.processes"]._FORK_CONTEXT = None

    state.restore = restore
_capture()
%reset -f
__import__("sys").modules["_shared_kernel_state"].restore(__FOLDER__)
"""

# Run after each notebook's last cell: its scratch folders (checkpoints, up to 2 GB) deleted as its kernel's exit
# would, now rather than when the next notebook starts; the tests a worker runs after its last notebook would
# otherwise wait beside them. A notebook that fails keeps them until the next one's `RESET_KERNEL`.
DELETE_SCRATCH = """
import os as _os, sys as _sys
_os.chdir(__FOLDER__)  # a notebook may work inside its scratch folder
if callable(globals().get("remove_scratch_dirs")):  # 00 defines its own (the cell core exports), with its own list
    remove_scratch_dirs()
if "tutorial_lib.core" in _sys.modules:
    _sys.modules["tutorial_lib.core"].remove_scratch_dirs()
"""


class SharedKernelNotebook(pytest.Item):
    """A notebook run top to bottom, as nbmake runs it (smoke mode, every cell must succeed), in the test process's
    one shared kernel, after `RESET_KERNEL`; its scratch folders are deleted after its last cell (`DELETE_SCRATCH`)."""

    _kernel = None  # the kernel manager, made by the first notebook of this process; its kernel stays up

    def runtest(self):
        import nbclient
        import nbformat
        from jupyter_client.manager import AsyncKernelManager

        nb = nbformat.read(self.path, as_version=4)
        folder = repr(str(self.path.parent))
        nb.cells.insert(0, nbformat.v4.new_code_cell(DELETE_SCRATCH.replace("__FOLDER__", folder)))
        nb.cells.insert(1, nbformat.v4.new_code_cell(RESET_KERNEL.replace("__FOLDER__", folder)))
        nb.cells.append(nbformat.v4.new_code_cell(DELETE_SCRATCH.replace("__FOLDER__", folder)))
        if SharedKernelNotebook._kernel is None:
            SharedKernelNotebook._kernel = AsyncKernelManager(kernel_name="python3")
        client = nbclient.NotebookClient(
            nb, km=SharedKernelNotebook._kernel, timeout=self.config.getoption("nbmake_timeout"), allow_errors=False
        )
        try:
            client.execute(cwd=str(self.path.parent))
        except nbclient.exceptions.CellExecutionError as err:
            raise NotebookCellFailed(str(err)) from None
        except BaseException:  # a dead or hung kernel (a timeout): the next notebook gets a new one
            SharedKernelNotebook.stop_kernel()
            raise

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, NotebookCellFailed):
            return f"{self.path.name}: a cell failed\n{excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, 0, f"{self.path.name} (shared kernel)"

    @classmethod
    def stop_kernel(cls):
        if cls._kernel is not None and cls._kernel.has_kernel:
            from jupyter_core.utils import run_sync

            # as a kernel ends when its notebook is closed: its exit handlers delete the last notebook's scratch folders
            run_sync(cls._kernel.shutdown_kernel)(now=False)
        cls._kernel = None


class NotebookCellFailed(Exception):
    """A cell of a notebook run in the shared kernel raised: its traceback, as nbclient reports it."""


class NotebooksInASharedKernel:
    """nbmake's items for the notebooks of `SHARED_KERNEL_FOLDERS`, replaced by `SharedKernelNotebook`s (same ids)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items):
        for k, item in enumerate(items):
            if (
                getattr(item, "nbmake", False)
                and any(item.nodeid.startswith(folder + "/") for folder in SHARED_KERNEL_FOLDERS)
                and item.nodeid.split("::")[0] not in OWN_KERNEL_NOTEBOOKS
            ):
                items[k] = SharedKernelNotebook.from_parent(item.parent, name=item.name)

    def pytest_sessionfinish(self, session, exitstatus):
        SharedKernelNotebook.stop_kernel()


def pytest_configure(config):
    config.pluginmanager.register(NotebooksRunInTheBrowser(), "notebooks-run-in-the-browser")
    config.pluginmanager.register(NotebooksInASharedKernel(), "notebooks-in-a-shared-kernel")


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Let the test process exit even if something a test started would hold it.

    At exit Python joins non-daemon threads and multiprocessing children: one child stuck in a
    collective would keep the finished run waiting forever. After `EXIT_GRACE_S` a daemon thread
    prints every thread's stack and leaves with the session's own status. Only the main pytest process does this:
    an xdist worker that is done first waits, idle, for the others."""
    if hasattr(config, "workerinput"):
        return  # a pytest-xdist worker waits here for the other workers; xdist ends it if it cannot exit
    status = config.stash.get(_EXIT_STATUS, 1)

    def leave():
        time.sleep(EXIT_GRACE_S)
        print(
            f"conftest: process {os.getpid()} still exiting {EXIT_GRACE_S} s after its tests ended; its threads:",
            file=sys.__stderr__,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        os._exit(status)

    threading.Thread(target=leave, name="exit-watchdog", daemon=True).start()
