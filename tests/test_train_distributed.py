"""tutorial_lib.train on 2 real CPU processes (gloo): DDP equivalence, exact metric counts, the schedule (forked
by `notebook_launcher`), and two simulated machines on loopback (`accelerate launch`, one per machine).

Every run trains `tinycnn` (no BatchNorm) on 80 embedded images for 2 epochs with the same seed.
The sampler is seeded by (seed, epoch) and every image's augmentation by (seed, epoch, index), so
2 processes x batch 8 see exactly the samples of 1 process x batch 16 at every optimizer step."""

import json
import math
import os
import subprocess
import sys

import pytest
from train_helpers import (
    ROOT,
    TINY,
    as_flags,
    assert_scaled_learning_rate,
    bitwise_equal,
    launch,
    max_weight_difference,
    weights,
)

from tutorial_lib.accel import read_metrics
from tutorial_lib.core import free_port
from tutorial_lib.flags import default_args
from tutorial_lib.train import train

# a test that starts processes or trains is marked slow (skipped by `pytest -m "not slow"`): the conftest checks it

ACCUMULATION = 3  # 5 batches per process and epoch -> optimizer steps of 3 and 2 micro-batches


# A 2-process run whose claim is not about `accelerate launch`: a fresh interpreter (no OpenMP thread has run in it,
# so it can fork) launches it with `notebook_launcher`, as 09 does: one cold start instead of the launcher's three.
FORKED_LAUNCH = r"""
import json, sys
from tutorial_lib.flags import default_args
from tutorial_lib.launching import launch_with_timeout
from tutorial_lib.train import train

launch_with_timeout(train, (default_args(**json.loads(sys.argv[1])),), num_processes=2, timeout=240)
"""


def launch_forked(options: dict) -> str:
    """Train `options` on 2 gloo processes forked by `notebook_launcher` in a fresh interpreter; return the output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-c", FORKED_LAUNCH, json.dumps(options)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"launch failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-process run, its 1-process twin, and the same 2 processes as 2 simulated machines."""
    tmp = tmp_path_factory.mktemp("distributed")
    # no --learning_rate: each run scales it to its global batch (0.1 per 256 images), which the launch prints
    common = {**TINY, "working_directory": str(tmp), "gradient_accumulation_steps": ACCUMULATION, "learning_rate": None}
    out = launch_forked({**common, "batch_size": 8, "experiment_name": "ddp"})
    single = train(default_args(**{**common, "batch_size": 16, "experiment_name": "single"}))

    # Two "machines" of one process each, rendezvous on 127.0.0.1: machine 1 in the background
    port = str(free_port())
    node = [
        "--multi_gpu",
        "--num_machines",
        "2",
        "--num_processes",
        "2",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        port,
    ]
    options = {**common, "batch_size": 8, "experiment_name": "two_machines"}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *node,
        "--machine_rank",
        "1",
        "-m",
        "tutorial_lib.train",
        *as_flags(options),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    machine1 = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out_machines = launch(options, launcher=[*node, "--machine_rank", "0"])
        rest, _ = machine1.communicate(timeout=240)
    finally:
        if machine1.poll() is None:  # machine 0 failed: do not leave machine 1 waiting at the rendezvous
            machine1.kill()
            machine1.communicate()
    assert machine1.returncode == 0, rest[-3000:]
    return {"tmp": tmp, "ddp_out": out, "single": single, "machines_out": out_machines}


def final_metrics(run_dir):
    return json.loads((run_dir / "final_metrics.json").read_text())


@pytest.mark.slow
def test_ddp_two_processes_batch_8_match_one_process_batch_16(runs):
    ddp = final_metrics(runs["tmp"] / "ddp")
    assert ddp["num_processes"] == 2 and runs["single"]["num_processes"] == 1
    assert ddp["global_batch_size"] == runs["single"]["global_batch_size"] == 16 * ACCUMULATION
    diff = max_weight_difference(weights(runs["tmp"] / "ddp"), weights(runs["tmp"] / "single"))
    assert diff <= 1e-6, f"DDP weights differ from the single-process run by {diff}"


@pytest.mark.slow
def test_only_the_main_process_prints(runs):
    assert runs["ddp_out"].count("best val top-1") == 1, runs["ddp_out"]
    assert runs["ddp_out"].count("2 process(es)") == 1


@pytest.mark.slow
def test_the_launch_prints_and_records_the_learning_rate_scaled_to_its_global_batch(runs):
    # 8 per process x 3 accumulated x 2 processes (on one process: test_train.py)
    assert_scaled_learning_rate(runs["ddp_out"], runs["tmp"] / "ddp", global_batch=8 * ACCUMULATION * 2)


@pytest.mark.slow
def test_metrics_count_every_sample_exactly_once_on_two_processes(runs):
    rows = read_metrics(runs["tmp"] / "ddp" / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert row["val_count"] == 37, "37 validation images on 2 processes x batch 8: padding must be dropped"
        assert row["train_count"] == 80
    single_rows = read_metrics(runs["tmp"] / "single" / "metrics.jsonl")
    for a, b in zip(rows, single_rows, strict=True):  # the curves of both runs, epoch by epoch
        assert a["train_count"] == b["train_count"] and a["train_top1"] == pytest.approx(b["train_top1"])
        assert a["val_top1"] == pytest.approx(b["val_top1"]) and a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_schedule_total_steps_and_final_lr_match_the_formula(runs, tmp_path):
    """Optimizer steps = epochs x ceil((len(train_loader) // processes) / accumulation), one scheduler step each
    (on one process: test_train.py). Neither run sets --learning_rate: the launch with accumulation 1 also prints
    and records the learning rate scaled to its global batch of 16."""

    def check(result, processes, accumulation, batch_size=8):
        batches = (80 // batch_size) // processes  # len(train_loader) after prepare
        steps = 2 * math.ceil(batches / accumulation)
        assert (result["num_processes"], result["optimizer_steps"], result["scheduler_steps"]) == (
            processes,
            steps,
            steps,
        )
        lr = 0.1 * batch_size * accumulation * processes / 256
        assert result["final_lr"] == pytest.approx(lr * 0.5**2)  # step decay 0.5 per epoch, 2 epochs
        assert result["lr"] == pytest.approx(lr * 0.5)  # the last optimizer step ran in epoch 1

    check(final_metrics(runs["tmp"] / "ddp"), processes=2, accumulation=ACCUMULATION)
    out = launch_forked(
        {
            **TINY,
            "working_directory": str(tmp_path),
            "experiment_name": "acc1",
            "batch_size": 8,
            "gradient_accumulation_steps": 1,
            "learning_rate": None,
        }
    )
    check(final_metrics(tmp_path / "acc1"), processes=2, accumulation=1)
    assert_scaled_learning_rate(out, tmp_path / "acc1", global_batch=16)


@pytest.mark.slow
def test_two_simulated_machines_match_one_machine_with_two_processes(runs):
    machines = final_metrics(runs["tmp"] / "two_machines")
    assert machines["num_processes"] == 2
    assert bitwise_equal(weights(runs["tmp"] / "two_machines"), weights(runs["tmp"] / "ddp"))
    assert read_metrics(runs["tmp"] / "two_machines" / "metrics.jsonl")[-1]["val_count"] == 37
