"""Run code cells in a real Jupyter kernel, as nbmake and JupyterLab do (not a test module)."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient


@contextmanager
def short_tmpdir():
    """A temporary folder with a short path, for a kernel's TMPDIR: multiprocessing puts its sockets
    there, a socket path may not exceed 107 bytes, and pytest's `tmp_path` under CI's TMPDIR is ~100."""
    with tempfile.TemporaryDirectory(prefix="k-", ignore_cleanup_errors=True) as path:
        yield Path(path)


def run_in_kernel(cells: list[str], tmpdir: Path) -> list[str]:
    """Execute `cells` in a new python3 kernel whose temporary folder is `tmpdir`, shut the kernel
    down the way nbclient does (a graceful request, then a kill after 5 s), and return each cell's
    printed text."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmpdir))  # the kernel inherits it, so tempfile uses it
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    return ["".join(o.get("text", "") for o in cell.outputs) for cell in nb.cells]
