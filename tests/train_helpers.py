"""Shared helpers of the tests (not a test module): runs of the training script, and its command line's outcomes.

Runs are small: `tinycnn` (no BatchNorm) or `resnet18` at 16-32 px on a seeded subset of the
embedded dataset, which is committed with the package (no download, no shared data)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tutorial_lib.cli import as_flags  # noqa: F401 (the tests import it from here too)
from tutorial_lib.core import free_port

ROOT = Path(__file__).resolve().parents[1]

# One epoch of tinycnn at batch 4 on the data a case gives it: the runs of the reliability cases.
CASE_RUN = dict(
    model="tinycnn",
    img_size=16,
    epochs=1,
    batch_size=4,
    learning_rate=0.05,
    num_workers=0,
    cpu=True,
    log_with="none",
    disable_progress_bar=True,
    log_interval=0,
)

# 80 training images: 10 batches of 8 or 5 batches of 16; 37 validation images divide by nothing.
TINY = dict(
    model="tinycnn",
    img_size=16,
    epochs=2,
    learning_rate=0.05,
    momentum=0.9,
    weight_decay=1e-4,
    lr_scheduler="step",
    lr_step_size=1,
    step_lr_decay=0.5,
    num_workers=0,
    cpu=True,
    max_train_samples=80,
    max_val_samples=37,
    disable_progress_bar=True,
    log_with="none",
)


def launch(options: dict, num_processes: int = 2, launcher: list[str] | None = None, timeout: int = 240) -> str:
    """Run `accelerate launch --multi_gpu ... -m tutorial_lib.train --cpu ...` (gloo) and return its output.

    `--multi_gpu` is accelerate's torchrun launcher; `--cpu` (passed to the script) makes the
    processes join a gloo group. `accelerate launch --cpu` would start a single process."""
    launcher = launcher or [
        "--multi_gpu",
        "--num_processes",
        str(num_processes),
        "--main_process_port",
        str(free_port()),
    ]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launcher,
        "-m",
        "tutorial_lib.train",
        *as_flags(options),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"launch failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(run_dir) / "model.safetensors")


def max_weight_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def exit_status(main, argv: list[str]) -> int:
    """The exit status of a command line run in this process: every `main` of the course (00a's `cli_main`) returns
    on success and raises `SystemExit(status)` otherwise."""
    try:
        main(argv)
    except SystemExit as exit_:
        return exit_.code
    return 0


def assert_scaled_learning_rate(out: str, run_dir: Path, global_batch: int) -> None:
    """A run started with no --learning_rate printed and recorded the scaled one: 0.1 per 256 images of the
    global batch (the output `out` of the run, its folder `run_dir`)."""
    import json

    expected = 0.1 * global_batch / 256
    assert f"lr {expected:.4g} = 0.1 x {global_batch} / 256" in out, out[-2000:]
    config = json.loads((Path(run_dir) / "config.json").read_text())
    assert config["learning_rate"] == pytest.approx(expected)
    assert (config["lr_base"], config["lr_base_batch"]) == (0.1, 256)
    assert config["lr_rule"].startswith(f"lr {expected:.4g} = 0.1 x {global_batch} / 256")


def assert_user_error(result, message: str, code: int = 2) -> None:
    """A refused input (`result`: a `tutorial_lib.processes.CliResult`): exit `code`, exactly one line
    `tutorial-train: error: <message>` on stderr, no traceback."""
    assert not result.has_traceback, f"a traceback was printed:\n{result.stderr[-2000:]}"
    assert result.returncode == code, (
        f"exit code {result.returncode}, expected {code}; stderr:\n{result.stderr[-2000:]}"
    )
    assert result.stderr_lines == [f"tutorial-train: error: {message}"], (
        f"stderr should be one line\n  tutorial-train: error: {message}\ngot:\n" + "\n".join(result.stderr_lines)
    )
