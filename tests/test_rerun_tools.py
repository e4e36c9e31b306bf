"""The data tools and the training command line run again, or signalled, at any moment (issue 41's items 5, 6, 13).

`shard` run again after its source changed rebuilds exactly the shards whose images or labels changed (notebook
07b §2); `prepare-val --out` on another file system moves so that a kill leaves the original or a complete copy
(07b §1); a SIGTERM while a finished or stopped run exits leaves it its own status (06b, 08b)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import CASE_RUN

from tutorial_lib.cli import as_flags
from tutorial_lib.launching import EXIT_STATUS_ENV, read_exit_status
from tutorial_lib.processes import child_env, make_image_folder

# --- item 13: a SIGTERM while the process exits ----------------------------------------------------------------


def sigterms_until_exit(tmp_path: Path, name: str, options: dict, first: str) -> tuple[int, int | None, str, str]:
    """Run the training command line, send SIGTERM once a stdout line starts with `first`, then every 20 ms until
    the process has exited: some land while Python shuts down. Returns (exit code, recorded status, stdout, stderr)."""
    status_file = tmp_path / f"{name}.status"
    flags = as_flags({**options, "working_directory": tmp_path / "runs", "experiment_name": name})
    env = {**child_env(), EXIT_STATUS_ENV: str(status_file)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tutorial_lib.train", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    seen = []
    for line in proc.stdout:  # the line printed, the signal follows
        seen.append(line)
        if line.startswith(first):
            break
    assert proc.poll() is None, f"the run ended before {first!r}:\n{''.join(seen)}\n{proc.stderr.read()[-3000:]}"
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.02)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, read_exit_status(status_file), "".join(seen) + out, err


@pytest.mark.slow
def test_sigterms_while_a_run_exits_leave_it_the_status_its_training_decided(tmp_path):
    """A complete run signalled from its last line on ends 0; a run stopped by SIGTERM and signalled again and again
    while it saves and exits ends 143 with its checkpoint (before: killed by a signal landing in Python's shutdown)."""
    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=8, val_per_class=2)
    done, status, out, err = sigterms_until_exit(
        tmp_path, "complete", {**CASE_RUN, "path_to_data": data}, first="best val top-1"
    )
    assert (done, status) == (0, 0), (done, status, err[-3000:])
    assert "Traceback" not in err and "stopped at optimizer step" not in out, err[-3000:]
    assert (tmp_path / "runs" / "complete" / "model.safetensors").exists()

    long = {**CASE_RUN, "epochs": 40, "path_to_data": data}
    done, status, out, err = sigterms_until_exit(tmp_path, "stopped", long, first="    0 ")
    assert (done, status) == (143, 143), (done, status, err[-3000:])
    assert "(SIGTERM): checkpoint saved" in out and "Traceback" not in err, (out[-2000:], err[-3000:])
    assert list((tmp_path / "runs" / "stopped" / "checkpoints").glob("step_*"))
