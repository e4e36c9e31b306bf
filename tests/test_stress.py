"""tutorial_lib.stress: the kill-anywhere resume harness and its helpers (notebook 11).

The CI version of the stress run: 2 trials, forked runs (the same `main` as `python -m
tutorial_lib.train`, without 5 s of imports per run). The full 10-trial run with
`python -m tutorial_lib.train` per run is `python -m tutorial_lib.stress resume --trials 10`."""
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from accelerate.data_loader import BatchSamplerShard
from kernel_helpers import run_in_kernel, short_tmpdir
from torch.utils.data import BatchSampler

from tutorial_lib.data import EpochSeededSampler, UnreadableImageError, build_datasets
from tutorial_lib.stress import (BAD_FILE_KINDS, CliResult, KillPlan, TrainingProcess, as_flags, assert_user_error,
                                 child_env, corrupt_image, draw_kill_plan, first_files_of_process, make_image_folder,
                                 stress_resume)

pytestmark = pytest.mark.slow  # starts processes or trains: skipped by `pytest -m "not slow"`


def test_two_stress_trials_end_bitwise_identical_within_a_minute(tmp_path):
    start = time.perf_counter()
    results = stress_resume(trials=2, seed=0, workdir=tmp_path, kills_per_trial=3, launcher="fork")
    seconds = time.perf_counter() - start
    assert all(r.passed for r in results), [r.summary() for r in results]
    kills = [k for r in results for k in r.kills if k.killed]
    assert len(kills) >= 2, [k.describe() for r in results for k in r.kills]
    assert any(r.runs > 1 and r.resumed_from for r in results), "no trial was resumed from a checkpoint"
    assert seconds < 60, f"the CI stress run took {seconds:.0f} s"


def test_kill_plans_are_seeded():
    plans = [draw_kill_plan(random.Random(t), 18, 2.0) for t in range(5)]
    again = [draw_kill_plan(random.Random(t), 18, 2.0) for t in range(5)]
    assert plans == again
    assert all(p.kind in ("during_save", "after_save", "random_time", "final_save") and 1 <= p.nth <= 18 for p in plans)
    assert KillPlan("during_save", nth=3, files=2).describe() == "during save #3 (after 2 file(s))"


@pytest.mark.parametrize("kind", BAD_FILE_KINDS)
def test_corrupted_images_cannot_be_decoded(tmp_path, kind):
    root = make_image_folder(tmp_path / "data", classes=2, train_per_class=3, val_per_class=1)
    bad = corrupt_image(root / "train" / "class_00" / "0001.jpg", kind)
    train_ds, _ = build_datasets(root, img_size=16)
    index = [path for path, _ in train_ds.samples].index(str(bad))
    with pytest.raises(UnreadableImageError, match="0001.jpg"):
        train_ds[index]


def test_first_files_of_process_are_what_accelerate_hands_that_process(tmp_path):
    root = make_image_folder(tmp_path / "data", classes=3, train_per_class=8, val_per_class=1)
    train_ds, _ = build_datasets(root, img_size=16)
    for rank in range(2):  # a fresh sampler each: iterating it advances its epoch
        batches = BatchSampler(EpochSeededSampler(len(train_ds), seed=0), batch_size=4, drop_last=True)
        first = next(iter(BatchSamplerShard(batches, num_processes=2, process_index=rank)))
        assert first_files_of_process(root, 4, rank, 2) == [train_ds.samples[i][0] for i in first]


def test_assert_user_error_rejects_tracebacks_extra_lines_and_wrong_codes():
    good = CliResult(2, "", "tutorial-train: error: --epochs must be >= 1, got 0\n", 0.1)
    assert_user_error(good, "--epochs must be >= 1, got 0")
    for bad in [CliResult(1, "", good.stderr, 0.1), CliResult(2, "", "Traceback (most recent call last):\n" + good.stderr, 0.1),
                CliResult(2, "", "a warning\n" + good.stderr, 0.1)]:
        with pytest.raises(AssertionError):
            assert_user_error(bad, "--epochs must be >= 1, got 0")


def test_stress_command_line_refuses_bad_counts():
    done = subprocess.run([sys.executable, "-m", "tutorial_lib.stress", "resume", "--trials", "0"], capture_output=True,
                          text=True, env=child_env(), timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("python -m tutorial_lib.stress: error: --trials and --epochs must be >= 1, "
                                   "--kills_per_trial >= 0")



def test_stress_command_line_deletes_its_temporary_folder_when_every_trial_passed():
    with short_tmpdir() as tmp:
        done = subprocess.run([sys.executable, "-m", "tutorial_lib.stress", "resume", "--trials", "1", "--kills_per_trial",
                               "1", "--epochs", "1", "--launcher", "fork"], capture_output=True, text=True,
                              env=child_env(TMPDIR=str(tmp)), timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "1/1 trials identical" in done.stdout
        assert not [p.name for p in tmp.iterdir() if p.name.startswith("tutorial-stress-")]


FORK_RUN_IN_A_KERNEL = """
import os
from tutorial_lib.core import scratch_dir
from tutorial_lib.stress import _fork_context, stop_fork_server

folder = scratch_dir("fork-test-")
run = _fork_context().Process(target=os.getpid)  # starts the fork server, a child of the kernel
run.start(); run.join(); assert run.exitcode == 0
print(folder)
"""


def test_a_kernel_that_used_the_fork_launcher_cleans_up_after_stop_fork_server():
    """Notebook 11's last cell. A kernel shutting down waits for its child processes; with the fork server
    and the resource tracker still there it waits ~30 s, is killed first, and its scratch folder stays."""
    count_children = "import psutil\nprint(len(psutil.Process().children(recursive=True)))"
    with short_tmpdir() as tmp:
        out = run_in_kernel([FORK_RUN_IN_A_KERNEL, count_children, "stop_fork_server()\n" + count_children], tmp)
        folder = Path(out[0].strip())
        assert folder.parent == tmp
        assert int(out[1]) >= 1 and int(out[2]) == 0, f"children before/after stop_fork_server: {out[1:]}"
        assert not folder.exists(), "the kernel exited and left its scratch folder behind"


def alive(processes: list) -> list:
    """The processes among `processes` that still run (psutil compares start times, so a reused pid is not
    mistaken for the old process; a zombie is dead)."""
    def running(p):
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    return [p for p in processes if running(p)]


@pytest.mark.parametrize("killed", [False, True])
def test_a_forked_run_with_loader_workers_leaves_no_process_behind(tmp_path, killed):
    """A forked run's data loader workers must die with it, as under `python -m tutorial_lib.train`
    (they used to come from a second fork server that nobody stopped)."""
    data = make_image_folder(tmp_path / "data")
    options = dict(model="tinycnn", img_size=16, epochs=40 if killed else 3, batch_size=8, learning_rate=0.05,
                   num_workers=2, cpu=True, log_with="none", disable_progress_bar=True, log_interval=0,
                   path_to_data=str(data), working_directory=str(tmp_path / "runs"), experiment_name="run")
    proc = TrainingProcess(as_flags(options), tmp_path / "log", "fork")
    run, seen, deadline = psutil.Process(proc.pid), {}, time.time() + 120
    while proc.poll() is None and time.time() < deadline:  # note every process the run starts
        try:
            seen.update({p.pid: p for p in run.children(recursive=True)})
        except psutil.Error:
            break
        if killed and len(seen) >= 2 and (tmp_path / "runs" / "run" / "metrics.jsonl").exists():
            proc.kill()  # in its second epoch or later, with workers running
            break
        time.sleep(0.05)
    descendants = list(seen.values())
    assert len(descendants) >= 2, f"the run should have started data loader workers: {descendants}"
    out = proc.result(timeout=120)
    assert out.returncode == (-9 if killed else 0), out.stderr[-2000:]
    deadline = time.time() + 20  # orphaned workers notice their parent is gone within 5 s
    while alive(descendants) and time.time() < deadline:
        time.sleep(0.5)
    left = alive(descendants)
    for p in left:
        p.kill()
    assert not left, f"{len(left)} of the run's {len(descendants)} child processes still run"
