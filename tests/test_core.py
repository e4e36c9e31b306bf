import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_helpers import run_in_kernel, short_tmpdir

from tutorial_lib.core import (bf16_supported, environment_report, free_port, global_batch_size,
                               smoke_mode, training_time_seconds)


def test_global_batch_is_the_product_of_micro_batch_accumulation_and_processes():
    assert global_batch_size(32, 4, 2) == 256
    assert global_batch_size(7) == 7


@pytest.mark.parametrize("bad", [(0, 1, 1), (8, 0, 1), (8, 1, -2), (2.5, 1, 1)])
def test_global_batch_refuses_non_positive_integers(bad):
    with pytest.raises(ValueError, match="positive integer"):
        global_batch_size(*bad)


def test_smoke_mode_reads_the_environment_variable(monkeypatch):
    monkeypatch.setenv("TUTORIAL_SMOKE", "1")
    assert smoke_mode()
    monkeypatch.setenv("TUTORIAL_SMOKE", "0")
    assert not smoke_mode()
    monkeypatch.delenv("TUTORIAL_SMOKE")
    assert not smoke_mode()


def test_training_time_is_images_times_epochs_over_throughput():
    assert training_time_seconds(100.0, images=1000, epochs=3) == pytest.approx(30.0)
    with pytest.raises(ValueError):
        training_time_seconds(0)


def test_free_port_gives_a_bindable_port_and_never_one_that_is_in_use():
    import socket
    port = free_port()
    assert 1024 < port < 65536
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))  # free: it can be bound
        held.listen()
        others = {free_port() for _ in range(5)}  # while it is taken, free_port must give other ports
    assert port not in others


def test_environment_report_names_versions_and_devices():
    report = environment_report()
    assert report["torch"] == torch.__version__
    assert report["cuda_available"] == torch.cuda.is_available()
    assert report["bf16_supported"] == bf16_supported()


@pytest.mark.slow
def test_console_script_prints_version_and_hardware():
    exe = Path(sys.executable).with_name("tutorial-lib")
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    assert out.startswith("tutorial_lib 0.")
    assert "cuda_available" in out and "bf16_supported" in out


@pytest.mark.slow
def test_importing_the_library_does_no_work():
    # No prints and no CUDA probing at import time (notebook_launcher needs CUDA untouched).
    code = ("import torch, tutorial_lib, tutorial_lib.core; "
            "assert not torch.cuda.is_initialized(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out == "ok\n"


SCRATCH_THEN_FORK = """
import os, sys
from tutorial_lib.core import scratch_dir
folder = scratch_dir("scratch-test-")
(folder / "checkpoint.bin").write_bytes(b"x" * 1000)
child = os.fork()
if child == 0:
    sys.exit(0)  # a child that exits normally runs the atexit handlers it inherited
os.waitpid(child, 0)
assert (folder / "checkpoint.bin").exists(), "a forked child deleted its parent's scratch folder"
print(folder)
"""


@pytest.mark.slow
def test_scratch_dir_is_deleted_when_its_process_exits_and_not_when_a_forked_child_does(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", SCRATCH_THEN_FORK], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    folder = Path(out.stdout.strip())
    assert folder.parent == tmp_path and folder.name.startswith("scratch-test-")
    assert not folder.exists(), "the folder outlived the process that made it"


@pytest.mark.slow
def test_a_notebook_kernel_deletes_its_scratch_folder_when_it_shuts_down():
    """What notebooks 06-11 rely on: a run under nbmake or JupyterLab leaves no checkpoints in /tmp."""
    with short_tmpdir() as tmp:
        out = run_in_kernel(["from tutorial_lib.core import scratch_dir\n"
                             "folder = scratch_dir('kernel-test-'); (folder / 'model.safetensors').write_bytes(b'x')\n"
                             "print(folder)"], tmp)
        folder = Path(out[0].strip())
        assert folder.parent == tmp
        assert not folder.exists(), "the kernel exited and left its scratch folder behind"
