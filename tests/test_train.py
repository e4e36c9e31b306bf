"""tutorial_lib.train in one process: command line, schedule, accumulation, outputs and exact resume.

The multi-process proofs (DDP, exact metric counts, schedule on 2 processes, simulated 2 machines)
are in test_train_distributed.py."""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from train_helpers import (
    ROOT,
    TINY,
    as_flags,
    assert_scaled_learning_rate,
    bitwise_equal,
    exit_status,
    max_weight_difference,
    weights,
)

from tutorial_lib.accel import read_metrics
from tutorial_lib.checkpoints import CheckpointError, latest_checkpoint, list_checkpoints
from tutorial_lib.cli import config_path
from tutorial_lib.core import free_port
from tutorial_lib.flags import (
    RECIPE_V1,
    BadFlagError,
    check_args,
    default_args,
    get_args_parser,
    resolve_learning_rate,
)
from tutorial_lib.sources import embedded_data_path
from tutorial_lib.train import build_training_scheduler, train

# a test that starts processes or trains is marked slow (skipped by `pytest -m "not slow"`): the conftest checks it


def run(tmp_path, name, **overrides) -> dict:
    return train(default_args(**{**TINY, "working_directory": str(tmp_path), "experiment_name": name, **overrides}))


# --- command line -------------------------------------------------------------------------------


def test_defaults_are_the_torchvision_v1_recipe_and_the_embedded_data():
    args = get_args_parser().parse_args([])
    for key, value in RECIPE_V1.items():
        assert getattr(args, key) == value, key
    assert (args.epochs, args.batch_size, args.momentum, args.weight_decay) == (90, 32, 0.9, 1e-4)
    assert (args.learning_rate, args.lr_base, args.lr_base_batch) == (None, 0.1, 256)  # 0.1 per 256: the rule
    assert (args.lr_scheduler, args.lr_step_size, args.step_lr_decay) == ("step", 30, 0.1)
    assert args.path_to_data == str(embedded_data_path()) and args.num_classes is None
    assert args.norm_weight_decay is None and args.bias_weight_decay is None  # V1: decay on every parameter
    assert args.min_crop_scale == 0.08  # torchvision's RandomResizedCrop scale=(0.08, 1)


def test_min_crop_scale_reaches_the_training_crops_and_is_checked_where_declared(capsys):
    from tutorial_lib.loading import base_dataset
    from tutorial_lib.train import load_data

    train_ds, _ = load_data(default_args(**{**TINY, "min_crop_scale": 0.35}))
    assert base_dataset(train_ds).transform.scale == (0.35, 1.0)
    for bad in ["0", "1.5", "nan"]:
        with pytest.raises(SystemExit) as stop:
            get_args_parser().parse_args(["--min_crop_scale", bad])
        assert stop.value.code == 2
        assert "--min_crop_scale" in capsys.readouterr().err


def test_help_says_batch_size_is_per_process_and_gives_the_global_batch_formula():
    text = get_args_parser().format_help()
    assert "PER PROCESS" in text
    assert "global batch = batch_size x gradient_accumulation_steps x num_processes" in text
    for flag in [
        "--experiment_name",
        "--path_to_data",
        "--working_directory",
        "--epochs",
        "--save_checkpoint_interval",
        "--num_classes",
        "--batch_size",
        "--gradient_accumulation_steps",
        "--learning_rate",
        "--weight_decay",
        "--momentum",
        "--step_lr_decay",
        "--lr_step_size",
        "--lr_warmup_epochs",
        "--lr_warmup_start_factor",
        "--bias_weight_decay",
        "--norm_weight_decay",
        "--max_grad_norm",
        "--img_size",
        "--num_workers",
        "--resume_from_checkpoint",
        "--mixed_precision",
        "--model",
        "--lr_scheduler",
        "--label_smoothing",
        "--seed",
        "--log_with",
    ]:
        assert flag in text, f"{flag} missing from --help"


@pytest.mark.slow
def test_console_script_exits_0_after_a_successful_run(tmp_path, monkeypatch):
    # setuptools' wrapper does `sys.exit(main())`: anything main() returned would become the exit status. Its own
    # code runs here, in this process: the claim is about what main() returns, not about starting a process.
    import signal

    from tutorial_lib.train import LATE_SIGNALS

    wrapper = Path(sys.executable).with_name("tutorial-train")
    argv = [
        "--model",
        "tinycnn",
        "--img_size",
        "16",
        "--epochs",
        "1",
        "--batch_size",
        "16",
        "--max_train_samples",
        "32",
        "--max_val_samples",
        "16",
        "--num_workers",
        "0",
        "--cpu",
        "--log_with",
        "none",
        "--disable_progress_bar",
        "--working_directory",
        str(tmp_path),
        "--experiment_name",
        "console",
    ]
    monkeypatch.setattr(sys, "argv", [str(wrapper), *argv])
    monkeypatch.chdir(tmp_path)
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in LATE_SIGNALS}
    try:  # main() as the process's command line keeps its signal handlers: this process gets its own back
        with pytest.raises(SystemExit) as exit_:
            exec(compile(wrapper.read_text(), str(wrapper), "exec"), {"__name__": "__main__"})
    finally:
        for name, handler in handlers.items():
            signal.signal(getattr(signal, name), handler)
    assert exit_.value.code in (None, 0), f"the console script would exit {exit_.value.code!r}"
    assert (tmp_path / "console" / "model.safetensors").exists()


def test_bad_options_are_refused_with_a_message_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"unknown options \['batchsize'\]; see `tutorial-train --help`"):
        default_args(batchsize=8)
    with pytest.raises(ValueError, match="--batch_size"):
        run(tmp_path, "bad", batch_size=0)
    with pytest.raises(ValueError, match="--num_classes"):
        run(tmp_path, "bad", num_classes=1000)
    with pytest.raises(FileNotFoundError, match="--path_to_data"):
        run(tmp_path, "bad", path_to_data=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="--resume_from_checkpoint"):
        run(tmp_path, "bad", resume_from_checkpoint=str(tmp_path))


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--seed", "5000000000"],
            "--seed must be a whole number from 0 to 4294967295 (NumPy's seeds are 32-bit), got 5000000000",
        ),
        (["--wandb_project", "a/b"], "--wandb_project 'a/b' contains /: a W&B project name has none of / \\ # ? % :"),
        (["--compile", "--compile_backend", "bogus"], "--compile_backend 'bogus' is not a torch.compile backend; use"),
    ],
)
def test_values_that_would_fail_later_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys, argv, line):
    # each used to pass the parser and end in a traceback (exit 1) once training started
    from tutorial_lib.train import main

    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--cpu", "--log_with", "none", "--working_directory", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith(f"tutorial-train: error: {line}"), err
    assert not any(tmp_path.iterdir()), "nothing written"


# --- schedule -----------------------------------------------------------------------------------


def lrs_of(args, steps_per_epoch: int) -> list[float]:
    """The LR of every optimizer step of `args`' schedule (on one process)."""
    args = resolve_learning_rate(args, num_processes=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    scheduler = build_training_scheduler(optimizer, args, steps_per_epoch)
    lrs = []
    for _ in range(steps_per_epoch * args.epochs):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_every_warmup_flag_shapes_the_schedule(tmp_path):
    steps = 10
    base = default_args(epochs=4, lr_scheduler="cosine", learning_rate=0.1)
    plain = lrs_of(base, steps)
    warm = lrs_of(default_args(epochs=4, lr_scheduler="cosine", learning_rate=0.1, lr_warmup_epochs=1), steps)
    assert plain[0] == pytest.approx(0.1) and warm[0] == pytest.approx(0.1 * 0.01)  # default start factor 0.01
    assert warm[steps] == pytest.approx(0.1)  # warmup lasts exactly --lr_warmup_epochs x steps per epoch
    assert all(a < b for a, b in zip(warm[:steps], warm[1 : steps + 1]))  # linear ramp
    factor = lrs_of(
        default_args(
            epochs=4, lr_scheduler="cosine", learning_rate=0.1, lr_warmup_epochs=1, lr_warmup_start_factor=0.25
        ),
        steps,
    )
    assert factor[0] == pytest.approx(0.025)
    half = lrs_of(default_args(epochs=4, lr_scheduler="cosine", learning_rate=0.1, lr_warmup_epochs=0.5), steps)
    assert half[5] == pytest.approx(0.1) and half[4] < 0.1  # fractional warmup epochs
    with pytest.raises(BadFlagError, match="--lr_warmup_epochs 2 covers the whole run"):  # before any data is read
        check_args(
            resolve_learning_rate(default_args(epochs=2, lr_warmup_epochs=2, working_directory=str(tmp_path)), 1)
        )


def test_step_schedule_decays_every_lr_step_size_epochs():
    lrs = lrs_of(default_args(epochs=90, learning_rate=0.1), steps_per_epoch=3)
    epoch_lr = [lrs[3 * e] for e in range(90)]
    assert epoch_lr[0] == epoch_lr[29] == pytest.approx(0.1)
    assert epoch_lr[30] == epoch_lr[59] == pytest.approx(0.01)
    assert epoch_lr[60] == epoch_lr[89] == pytest.approx(0.001)


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 3])
def test_schedule_total_steps_and_final_lr_match_the_formula_on_one_process(tmp_path, accumulation):
    result = run(tmp_path, f"sched{accumulation}", batch_size=8, gradient_accumulation_steps=accumulation)
    steps_per_epoch = math.ceil((80 // 8) / accumulation)  # 10 batches; the last window may be short
    assert result["optimizer_steps"] == result["scheduler_steps"] == 2 * steps_per_epoch
    assert result["final_lr"] == pytest.approx(0.05 * 0.5**2)  # step decay 0.5 per epoch, after 2 epochs
    assert result["lr"] == pytest.approx(0.05 * 0.5)  # the LR the last optimizer step used


# --- accumulation -------------------------------------------------------------------------------


@pytest.mark.slow
def test_accumulation_8x4_gives_the_same_weights_as_batch_32(tmp_path):
    options = dict(max_train_samples=64, epochs=2)  # 2 optimizer steps per epoch either way
    big = run(tmp_path, "b32", batch_size=32, gradient_accumulation_steps=1, **options)
    small = run(tmp_path, "b8x4", batch_size=8, gradient_accumulation_steps=4, **options)
    assert big["optimizer_steps"] == small["optimizer_steps"] == 4
    diff = max_weight_difference(weights(tmp_path / "b32"), weights(tmp_path / "b8x4"))
    assert diff <= 1e-6, f"accumulated weights differ by {diff}"
    assert small["train_loss"] == pytest.approx(big["train_loss"], rel=1e-5)


# --- outputs ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_outputs_metrics_lines_and_checkpoint_rotation(tmp_path):
    result = run(tmp_path, "out", batch_size=8, epochs=3, keep_last_checkpoints=2, checkpoint_every_steps=4)
    run_dir = tmp_path / "out"
    assert {"checkpoints", "metrics.jsonl", "model.safetensors", "config.json", "final_metrics.json"} <= {
        p.name for p in run_dir.iterdir()
    }
    assert not (run_dir / "wandb_run_id.txt").exists(), "--log_with none: no W&B file"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert {
            "epoch",
            "train_loss",
            "train_top1",
            "val_loss",
            "val_top1",
            "val_top5",
            "lr",
            "images_per_sec",
        } <= row.keys()
        assert row["train_count"] == 80 and row["val_count"] == 37 and row["images_per_sec"] > 0
    assert [r["step"] for r in rows] == [10, 20, 30]
    names = [p.name for p in list_checkpoints(run_dir)]
    assert names == ["step_000000028", "step_000000030"], names  # last 2 of the mid-epoch and epoch-end ones
    assert not any(p.name.startswith(".tmp") for p in (run_dir / "checkpoints").iterdir())
    final_ckpt = weights(latest_checkpoint(run_dir))
    assert bitwise_equal(final_ckpt, weights(run_dir))  # model.safetensors = final weights, model only
    assert json.loads((run_dir / "config.json").read_text())["global_batch_size"] == 8
    assert json.loads((run_dir / "config.json").read_text())["run_id"] == result["wandb_run_id"]


@pytest.mark.slow
def test_shipped_accelerate_configs_and_slurm_script_are_valid():
    from accelerate.commands.config.config_args import load_config_from_file

    expected = {
        "1gpu.yaml": (1, 1),
        "8gpus.yaml": (8, 1),
        "2nodes_8gpus.yaml": (16, 2),
        "cpu_2proc.yaml": (2, 1),
        "fsdp_8gpus.yaml": (8, 1),
    }
    for name, (processes, machines) in expected.items():
        config = load_config_from_file(str(config_path(name)))
        assert (config.num_processes, config.num_machines) == (processes, machines), name
        assert yaml.safe_load(config_path(name).read_text())["main_training_function"] == "main"
    slurm = config_path("slurm_2nodes_8gpus.sbatch")
    subprocess.run(["bash", "-n", str(slurm)], check=True)
    text = slurm.read_text()
    assert "#SBATCH --nodes=2" in text and '--machine_rank "$SLURM_NODEID"' in text and "2nodes_8gpus.yaml" in text
    # a warning ahead of the time limit, passed on as SIGTERM (the script's polite stop), then a requeue
    assert "#SBATCH --signal=B:USR1@" in text and 'kill -TERM "$training"' in text and "scontrol requeue" in text
    assert "--checkpoint_every_steps" in text and "--resume_from_checkpoint latest" in text
    with pytest.raises(FileNotFoundError, match="choose one of"):
        config_path("16gpus.yaml")


# --- exact resume -------------------------------------------------------------------------------

RESUME = dict(
    model="resnet18",
    img_size=32,
    batch_size=16,
    gradient_accumulation_steps=3,
    epochs=2,
    max_train_samples=112,
    lr_scheduler="cosine",
    lr_warmup_epochs=0.5,
)
# 7 batches per epoch, accumulation 3: optimizer steps of 3, 3 and 1 micro-batches, 3 steps per epoch.


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    result = run(tmp, "run", **RESUME)
    return tmp / "run", result


@pytest.mark.slow
@pytest.mark.parametrize("stop_after_steps,where,workers", [(3, "epoch boundary", 0), (2, "mid-epoch", 2)])
def test_stop_and_resume_gives_bitwise_identical_weights(tmp_path, straight_run, stop_after_steps, where, workers):
    """The straight run loads data in the main process; the mid-epoch case uses 2 persistent workers
    before and after the stop, so it also proves that augmentation does not depend on workers."""
    straight_dir, straight = straight_run
    stopped = run(tmp_path, "run", **RESUME, stop_after_steps=stop_after_steps, num_workers=workers)
    assert stopped["stopped"] and not stopped["finished"] and not (tmp_path / "run" / "model.safetensors").exists()
    assert latest_checkpoint(tmp_path / "run").name == f"step_{stop_after_steps:09d}"
    resumed = run(tmp_path, "run", **RESUME, resume_from_checkpoint="latest", num_workers=workers)
    assert resumed["finished"] and resumed["optimizer_steps"] == straight["optimizer_steps"] == 6
    assert bitwise_equal(weights(straight_dir), weights(tmp_path / "run")), (
        f"weights differ after a stop at the {where}"
    )
    rows_straight = read_metrics(straight_dir / "metrics.jsonl")
    rows_resumed = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["epoch"] for r in rows_resumed] == [0, 1] and [r["step"] for r in rows_resumed] == [3, 6]
    for a, b in zip(rows_straight, rows_resumed, strict=True):
        for key in ["train_loss", "train_top1", "val_loss", "val_top1", "val_top5", "lr", "train_count", "val_count"]:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (where, key)  # float32 metric states
    assert resumed["wandb_run_id"] == stopped["wandb_run_id"]  # the same W&B run continues


@pytest.mark.slow
def test_resume_latest_without_a_checkpoint_starts_from_scratch(tmp_path):
    result = run(tmp_path, "fresh", batch_size=16, epochs=1, resume_from_checkpoint="latest")
    assert result["finished"] and result["optimizer_steps"] == 5


@pytest.mark.slow
def test_resumed_run_continues_the_same_wandb_run_with_monotonic_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # real wandb, no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    options = dict(batch_size=16, epochs=2, log_with="wandb", log_interval=1)  # 5 optimizer steps per epoch
    stopped = run(tmp_path, "wb", **options, stop_after_steps=7)  # mid-epoch 1
    resumed = run(tmp_path, "wb", **options, resume_from_checkpoint="latest")
    run_id = stopped["wandb_run_id"]
    assert resumed["wandb_run_id"] == run_id and resumed["finished"]
    offline_runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>[-<n>]: W&B appends -1 when both runs start within the same second
    assert offline_runs and {p.name.split("-")[3] for p in offline_runs} == {run_id}
    steps = [r["step"] for r in read_metrics(tmp_path / "wb" / "metrics.jsonl")]
    assert steps == [5, 10]


def test_onecycle_without_warmup_is_refused_with_the_flag_to_change(tmp_path):
    with pytest.raises(BadFlagError, match="--lr_warmup_epochs"):  # by the flag checks, before any data is read
        check_args(
            resolve_learning_rate(default_args(epochs=2, lr_scheduler="onecycle", working_directory=str(tmp_path)), 1)
        )
    lrs = lrs_of(
        default_args(epochs=2, lr_scheduler="onecycle", lr_warmup_epochs=0.6, learning_rate=0.1), steps_per_epoch=5
    )
    assert max(lrs) == pytest.approx(0.1) and lrs.index(max(lrs)) == 3


@pytest.mark.slow
def test_gradient_clipping_bounds_every_optimizer_step(tmp_path):
    """Plain SGD (no momentum, no decay) with --max_grad_norm c moves the weights by at most lr x c per step."""
    plain = dict(batch_size=16, epochs=1, momentum=0.0, weight_decay=0.0, lr_scheduler="constant", learning_rate=0.05)
    # lr 1e-30 (0 is refused): every update is below float32 resolution, so model.safetensors = the initial weights
    run(tmp_path, "init", **{**plain, "learning_rate": 1e-30})
    clipped = run(tmp_path, "clipped", **plain, max_grad_norm=1e-3, gradient_accumulation_steps=2)
    run(tmp_path, "free", **plain, gradient_accumulation_steps=2)
    init, w_clipped, w_free = weights(tmp_path / "init"), weights(tmp_path / "clipped"), weights(tmp_path / "free")

    def moved(w: dict) -> float:
        return sum(((w[k] - init[k]).double() ** 2).sum() for k in w).sqrt().item()

    assert clipped["optimizer_steps"] == 3  # 5 batches, accumulation 2: clipping happens on the 3 sync steps only
    assert 0 < moved(w_clipped) <= 3 * 0.05 * 1e-3 * (1 + 1e-4)
    assert moved(w_free) > 100 * moved(w_clipped)


@pytest.mark.slow
def test_mid_epoch_resume_with_another_batch_size_is_refused(tmp_path):
    run(tmp_path, "layout", batch_size=16, epochs=1, stop_after_steps=2)
    with pytest.raises(ValueError, match="same set-up"):
        run(tmp_path, "layout", batch_size=8, epochs=1, resume_from_checkpoint="latest")


# --- the learning rate follows the global batch -----------------------------------------------------


@pytest.mark.parametrize(
    "batch_size, accumulation, processes, lr, warmup",
    [
        (32, 1, 8, 0.1, 0.0),
        (32, 8, 1, 0.1, 0.0),
        (32, 1, 1, 0.0125, 0.0),
        (128, 1, 8, 0.4, 3.75),
        (8, 3, 2, 0.01875, 0.0),
    ],
)
def test_default_learning_rate_and_warmup_follow_the_global_batch(batch_size, accumulation, processes, lr, warmup):
    args = resolve_learning_rate(
        default_args(batch_size=batch_size, gradient_accumulation_steps=accumulation), processes
    )
    assert args.learning_rate == pytest.approx(lr, rel=1e-12) and args.lr_warmup_epochs == warmup
    explicit = resolve_learning_rate(
        default_args(batch_size=batch_size, learning_rate=0.3, lr_warmup_epochs=1), processes
    )
    assert (explicit.learning_rate, explicit.lr_warmup_epochs) == (0.3, 1), "explicit values win"


def test_the_v1_defaults_at_global_batch_256_are_torchvisions_recipe():
    args = resolve_learning_rate(default_args(), num_processes=8)
    assert (args.batch_size, args.learning_rate, args.lr_warmup_epochs, args.momentum, args.weight_decay) == (
        32,
        0.1,
        0.0,
        0.9,
        1e-4,
    )
    assert (args.lr_scheduler, args.lr_step_size, args.step_lr_decay, args.epochs) == ("step", 30, 0.1, 90)


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 3])  # on 2 processes: test_train_distributed.py's launches
def test_the_run_prints_and_records_the_scaled_learning_rate(tmp_path, accumulation):
    import contextlib
    import io

    options = {
        **TINY,
        "batch_size": 8,
        "gradient_accumulation_steps": accumulation,
        "epochs": 1,
        "working_directory": str(tmp_path),
        "experiment_name": "lr",
        "learning_rate": None,
    }
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(default_args(**options))
    assert_scaled_learning_rate(printed.getvalue(), tmp_path / "lr", global_batch=8 * accumulation)


# --- the first hour: launches and outputs say what happens ---------------------------------------------


def run_cli_process(tmp_path, argv, env_extra=None, launcher=None, umask=None, timeout=300):
    """Run the training command line (or an `accelerate launch` of it) with stdout and stderr to files, as a
    batch job would; returns (exit code, stdout, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(env_extra or {})}
    cmd = (
        [sys.executable, "-m", *(launcher or []), *(["-m"] if launcher else []), "tutorial_lib.train", *argv]
        if launcher
        else [sys.executable, "-m", "tutorial_lib.train", *argv]
    )
    with open(tmp_path / "out.log", "w") as out, open(tmp_path / "err.log", "w") as err:
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
            timeout=timeout,
            preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
        )
    return done.returncode, (tmp_path / "out.log").read_text(), (tmp_path / "err.log").read_text()


def tiny_flags(tmp_path, name="first", **extra):
    options = {
        **TINY,
        "epochs": 2,
        "batch_size": 16,
        "working_directory": str(tmp_path / "runs"),
        "experiment_name": name,
        **extra,
    }
    options.pop("disable_progress_bar")  # the progress display is part of what is checked
    return as_flags(options)


def run_cli_here(capfd, argv, umask=None) -> tuple[int, str, str]:
    """Run the training command line in this process, its output going to files (pytest's `capfd` puts files on
    file descriptors 1 and 2, as a batch job's log does), under `umask` if given; returns (exit code, stdout,
    stderr). For claims about what a run writes; a launcher, a signal or a cold start needs its own process."""
    from tutorial_lib.train import main

    capfd.readouterr()
    previous = os.umask(umask) if umask is not None else None
    try:
        code = exit_status(main, argv)
    finally:
        if previous is not None:
            os.umask(previous)
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.slow
def test_a_run_logged_to_files_has_no_carriage_returns_one_table_and_files_the_umask_allows(tmp_path, capfd):
    code, out, err = run_cli_here(capfd, tiny_flags(tmp_path), umask=0o027)
    assert code == 0, err[-2000:]
    assert "\r" not in out + err, "a log must not receive a progress bar's carriage returns"
    assert out.count("train_loss") == 1, "the per-epoch table is printed once, row by row"
    assert "img/s (all processes)" in out
    run = tmp_path / "runs" / "first"
    for name in ["model.safetensors", "config.json", "metrics.jsonl"]:
        assert (run / name).stat().st_mode & 0o777 == 0o640, (name, oct((run / name).stat().st_mode))
    for f in latest_checkpoint(run).iterdir():
        assert f.stat().st_mode & 0o777 == 0o640, (f.name, oct(f.stat().st_mode))


@pytest.mark.slow
def test_a_start_that_fails_leaves_no_empty_run_folder(tmp_path, capfd):
    code, out, err = run_cli_here(capfd, tiny_flags(tmp_path, num_classes=7))
    assert code == 2 and "--num_classes 7 but" in err
    assert not (tmp_path / "runs" / "first").exists(), "the folder made for a run that never started must go"


@pytest.mark.slow
def test_accelerate_launch_cpu_with_two_processes_says_it_starts_one_and_how_to_get_two(tmp_path):
    launcher = ["accelerate.commands.launch", "--cpu", "--num_processes", "2", "--main_process_port", str(free_port())]
    code, out, err = run_cli_process(tmp_path, tiny_flags(tmp_path), launcher=launcher)
    assert code != 0, "the launch must not train one process as if two had been asked"  # accelerate reports 1
    line = [text for text in err.splitlines() if text.startswith("tutorial-train: error:")]
    assert len(line) == 1 and "starts one process, not N" in line[0] and "--multi_gpu --num_processes N" in line[0]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens on a machine without a GPU")
def test_a_gpu_config_on_a_machine_without_a_gpu_says_so_at_start(tmp_path):
    launcher = ["accelerate.commands.launch", "--config_file", str(config_path("1gpu.yaml"))]
    code, out, err = run_cli_process(tmp_path, tiny_flags(tmp_path, epochs=1, cpu=False), launcher=launcher)
    assert code == 0, err[-2000:]
    first = out.splitlines()[0]
    assert first.startswith("note: no GPU found: training on the CPU in bf16, many times slower than on a GPU"), first


@pytest.mark.slow
def test_help_shows_every_default_and_costs_little_more_than_importing_torch(tmp_path):
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, cwd=ROOT)
    torch_s = time.perf_counter() - start
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tutorial_lib.train", "--help"], capture_output=True, text=True, cwd=ROOT, check=True
    )
    help_s = time.perf_counter() - start
    assert done.stdout.startswith("usage: tutorial-train"), done.stdout[:200]  # `python -m` reaches the parser
    assert help_s < 1.5 * torch_s + 1.0, f"--help took {help_s:.1f} s, importing torch {torch_s:.1f} s"
    blocks, text = {}, done.stdout  # one block per option: its line and the wrapped lines of its help below
    for block in re.split(r"\n(?=  -)", text):
        block = " ".join(block.split())
        if block.startswith("-"):
            blocks[block.split()[0].rstrip(",")] = block
    options = [
        a.option_strings[-1]
        for a in get_args_parser()._actions
        if a.option_strings and a.help != argparse.SUPPRESS and a.dest != "help"
    ]
    assert options and set(options) <= set(blocks), sorted(set(options) - set(blocks))
    assert all("(default:" in blocks[o] for o in options), [o for o in options if "(default:" not in blocks[o]]
    assert "--inject_nan_at_steps" not in text, "a testing hook is not for users"


def test_readme_quick_start_command_parses_with_the_script_flags():
    """The README's quick start is copied by every newcomer: each of its flags must exist and parse."""
    import shlex

    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("tutorial-train --cpu") :]
    command = block[: block.index("```")].replace("\\\n", " ")
    args = get_args_parser(exit_on_error=False).parse_args(shlex.split(command)[1:])
    assert (args.model, args.img_size, args.min_crop_scale, args.zero_init_residual) == ("resnet18", 32, 0.5, True)
    assert args.cpu and args.log_with == ["none"]


@pytest.mark.slow
@pytest.mark.parametrize("change", [{"seed": 1}, {"max_train_samples": 64}])
def test_mid_epoch_resume_with_another_order_of_batches_is_refused(tmp_path, change):
    """Another --seed or training set skips other images than the ones the checkpoint trained."""
    run(tmp_path, "order", batch_size=16, epochs=1, stop_after_steps=2)
    flag = "--" + next(iter(change))
    with pytest.raises(CheckpointError, match=rf"saved mid-epoch with \(.*{flag}.*\) = .*same set-up"):
        run(tmp_path, "order", batch_size=16, epochs=1, resume_from_checkpoint="latest", **change)


@pytest.mark.slow
def test_mid_epoch_resume_needs_as_many_training_images_wherever_the_data_folder_is(tmp_path):
    """A mid-epoch checkpoint's batches are positions in a shuffle of the training split: a folder with one image more
    is refused in one line (its shuffle puts other images at those positions); a copy of the folder at another path
    resumes and finishes the epoch."""
    import shutil

    from tutorial_lib.processes import make_image_folder

    data = make_image_folder(tmp_path / "data", classes=3, train_per_class=8, val_per_class=2)  # 24: 6 batches of 4
    options = dict(batch_size=4, epochs=1, max_train_samples=None, max_val_samples=None)
    run(tmp_path, "moved", **options, path_to_data=str(data), stop_after_steps=2)
    bigger = shutil.copytree(data, tmp_path / "bigger")
    first = sorted((bigger / "train").glob("*/*"))[0]
    shutil.copy(first, first.with_name("one_more" + first.suffix))
    with pytest.raises(CheckpointError, match=r"training images\) = \(.*, 24\), not \(.*, 25\): resume with the same"):
        run(tmp_path, "moved", **options, path_to_data=str(bigger), resume_from_checkpoint="latest")
    copy = shutil.copytree(data, tmp_path / "copy")
    resumed = run(tmp_path, "moved", **options, path_to_data=str(copy), resume_from_checkpoint="latest")
    assert resumed["optimizer_steps"] == 6 and not resumed["stopped"], resumed


@pytest.mark.slow
def test_a_resume_says_what_it_cannot_do_and_records_what_it_changed(tmp_path):
    """--ema added, --epochs below the epochs done: one line each; --stop_after_steps already reached trains no
    step more; an epoch-end resume with another --seed and --max_grad_norm records both in config.json."""
    options = dict(batch_size=16, epochs=2)  # 80 images: 5 optimizer steps per epoch
    run(tmp_path, "r", **options, stop_after_steps=5)
    saved = latest_checkpoint(tmp_path / "r")
    ema_added = r"holds 0 registered object\(s\) .* registers 1: it was saved with another --ema setting"
    with pytest.raises(CheckpointError, match=ema_added):
        run(tmp_path, "r", **options, ema=True, resume_from_checkpoint="latest")
    again = run(tmp_path, "r", **options, stop_after_steps=5, resume_from_checkpoint="latest")
    assert again["stopped"] and again["optimizer_steps"] == 5, "no step past --stop_after_steps"
    assert list_checkpoints(tmp_path / "r") == [saved], "nothing trained, nothing saved"
    done = run(tmp_path, "r", **options, seed=3, max_grad_norm=1.0, resume_from_checkpoint="latest")
    assert done["finished"] and done["optimizer_steps"] == 10
    changes = json.loads((tmp_path / "r" / "config.json").read_text())["changes"]
    assert {"step": 5, "flag": "seed", "from": 0, "to": 3} in changes, changes
    assert {"step": 5, "flag": "max_grad_norm", "from": None, "to": 1.0} in changes, changes
    with pytest.raises(BadFlagError, match=r"^--epochs 1 but .*step_000000010 has 2 epochs done: give --epochs 2"):
        run(tmp_path, "r", **{**options, "epochs": 1}, resume_from_checkpoint="latest")
