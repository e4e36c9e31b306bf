"""tutorial_lib.stress, the kill-anywhere resume harness (notebook 11b), and tutorial_lib.processes, which runs the
training script in processes of its own for it (notebook 11a).

The quick stress run (2 trials: one forked, one under `accelerate launch`) is notebook 11b's, which the suite runs
in smoke mode and whose check asserts it; here: the harness's parts, its command line, and the process tools. The full
10-trial run is `python -m tutorial_lib.stress resume --trials 10`."""

import os
import random
import time
from pathlib import Path

import psutil
import pytest
from accelerate.data_loader import BatchSamplerShard
from kernel_helpers import run_in_kernel, short_tmpdir
from torch.utils.data import BatchSampler
from train_helpers import assert_user_error

from tutorial_lib.cli import as_flags
from tutorial_lib.loading import EpochSeededSampler, build_datasets
from tutorial_lib.processes import (
    BAD_FILE_KINDS,
    CliResult,
    TrainingProcess,
    can_mount_small_disk,
    child_env,
    corrupt_image,
    first_files_of_process,
    make_image_folder,
    run_cli,
)
from tutorial_lib.sources import UnreadableImageError
from tutorial_lib.stress import (
    KILL_KINDS,
    KillPlan,
    KillRecord,
    draw_kill_plan,
    scale_kill_plan,
    sigterm_problem,
    stopped_at_step,
    stress_resume,
    trial_kill_plans,
)

# a test that starts processes or trains is marked slow (skipped by `pytest -m "not slow"`): the conftest checks it


def test_kill_plans_are_seeded():
    plans = [draw_kill_plan(random.Random(t), 18, 2.0) for t in range(5)]
    again = [draw_kill_plan(random.Random(t), 18, 2.0) for t in range(5)]
    assert plans == again
    assert all(p.kind in KILL_KINDS and 1 <= p.nth <= 18 and 0 <= p.seconds <= 2.0 for p in plans)
    assert KillPlan("during_save", nth=3, files=2).describe() == "during save #3 (after 2 file(s))"
    assert KillPlan("sigterm", seconds=0.25).describe() == "SIGTERM 0.25 s into training"
    assert {draw_kill_plan(random.Random(t), 18, 2.0, kinds=("sigterm",)).kind for t in range(20)} == {"sigterm"}


def test_the_default_stress_run_mixes_sigterm_with_sigkill_and_its_plans_do_not_depend_on_timing():
    """The 10 trials of `python -m tutorial_lib.stress resume` (seed 0, 3 kills each, 18 saves): the plans are drawn
    up front, so they are the same on every machine however fast its runs go."""
    plans = [trial_kill_plans(0, t, 3, 18, 1.5) for t in range(10)]
    assert plans == [trial_kill_plans(0, t, 3, 18, 1.5) for t in range(10)]
    kinds = [p.kind for trial in plans for p in trial]
    assert kinds.count("sigterm") >= 5 and kinds.count("during_save") >= 10, kinds
    assert any(p.kind == "sigterm" for p in plans[0]) and any(p.kind == "sigterm" for p in plans[1]), (
        "the 2 trials of CI and notebook 11b include a SIGTERM"
    )
    assert trial_kill_plans(1, 0, 3, 18, 1.5) != plans[0], "another seed, other plans"


def test_a_plan_shrinks_to_the_part_of_the_run_that_is_left():
    plan = KillPlan("during_save", nth=12, files=3, seconds=1.2)
    assert scale_kill_plan(plan, saves=18, saves_left=18) == plan
    half = scale_kill_plan(plan, saves=18, saves_left=9)
    assert (half.kind, half.nth, half.files, half.seconds) == ("during_save", 6, 3, pytest.approx(0.6))
    assert scale_kill_plan(KillPlan("after_save", nth=1), saves=18, saves_left=1).nth == 1
    assert scale_kill_plan(plan, saves=18, saves_left=0).nth == 1, "never a save number below 1"


def test_a_sigterm_must_end_in_exit_143_after_a_checkpoint_of_the_step_it_names():
    plan = KillPlan("sigterm", seconds=0.5)
    stdout = "epoch ...\nstopped at optimizer step 14, in epoch 1 (SIGTERM): checkpoint saved, resume with ...\n"
    assert stopped_at_step(stdout) == 14 and stopped_at_step("no such line") is None
    good = KillRecord(plan, True, complete_step=14, exit_code=143, stopped_at=14)
    assert sigterm_problem(good, final_step=36) == ""
    assert "exit -15" in sigterm_problem(KillRecord(plan, True, complete_step=12, exit_code=-15), final_step=36), (
        "killed by the signal during training: work was lost"
    )
    assert sigterm_problem(KillRecord(plan, True, complete_step=36, exit_code=-15), final_step=36) == "", (
        "training was over and its last checkpoint complete: the signal only ended the process on its way out"
    )
    assert sigterm_problem(KillRecord(plan, True, complete_step=36, exit_code=0), final_step=36) == "", (
        "training was over: the command line finished with the run's status"
    )
    assert "exit 0" in sigterm_problem(KillRecord(plan, True, complete_step=12, exit_code=0), final_step=36), (
        "a run that went on to the end after SIGTERM mid-training ignored it"
    )
    assert "newest complete checkpoint is step 12" in sigterm_problem(
        KillRecord(plan, True, complete_step=12, exit_code=143, stopped_at=14), final_step=36
    )


@pytest.mark.slow
def test_sigterm_trials_checkpoint_exit_143_and_resume_bitwise_identical(tmp_path):
    results = stress_resume(
        trials=1, seed=0, workdir=tmp_path, kills_per_trial=2, launcher="fork", kinds=("sigterm",), verbose=False
    )
    assert all(r.passed for r in results), [r.summary() for r in results]
    terms = [k for r in results for k in r.kills if k.killed]
    assert terms and all(k.plan.kind == "sigterm" and k.exit_code == 143 for k in terms), [k.describe() for k in terms]
    assert all(k.stopped_at == k.complete_step for k in terms)
    assert results[0].resumed_from, "the run was resumed from the SIGTERM checkpoint"


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
    for bad in [
        CliResult(1, "", good.stderr, 0.1),
        CliResult(2, "", "Traceback (most recent call last):\n" + good.stderr, 0.1),
        CliResult(2, "", "a warning\n" + good.stderr, 0.1),
    ]:
        with pytest.raises(AssertionError):
            assert_user_error(bad, "--epochs must be >= 1, got 0")


def test_stress_command_line_refuses_bad_values_in_one_line(capsys):
    # `--trials 0` and its exact line: notebook 11b's check; `python -m tutorial_lib.stress` itself: test_bench's
    from tutorial_lib.stress import main

    for argv, message in [
        (["resume", "--kills_per_trial", "-1"], "--kills_per_trial must be >= 0, got -1"),
        (["resume", "--epochs", "0"], "--epochs must be >= 1, got 0"),
        (
            ["resume", "--kinds", "sighup"],
            "--kinds invalid choice: 'sighup' (choose from "
            "'during_save', 'after_save', 'random_time', 'final_save', "
            "'sigint', 'sigterm')",
        ),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2, argv
        assert capsys.readouterr().err.endswith(f": error: {message}\n"), argv
    with pytest.raises(ValueError, match="kinds must be some of"):
        stress_resume(trials=1, kinds=("sighup",))


@pytest.mark.slow
def test_stress_command_line_deletes_its_temporary_folder_when_every_trial_passed(capsys, monkeypatch):
    """Its `main`, in this process (its runs forked from the server, as `--launcher fork` starts them)."""
    import tempfile

    from tutorial_lib.stress import main

    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *args, **kwargs: made.append(mkdtemp(*args, **kwargs)) or made[-1])
    argv = ["resume", "--trials", "1", "--kills_per_trial", "1", "--epochs", "1", "--launcher", "fork"]
    main([*argv, "--accelerate_trials", "0"])  # returns when every trial passed (exit 0); else SystemExit(1)
    assert "1/1 trials identical" in capsys.readouterr().out
    workdirs = [Path(p) for p in made if Path(p).name.startswith("tutorial-stress-")]
    assert len(workdirs) == 1 and not workdirs[0].exists(), workdirs


FORK_RUN_IN_A_KERNEL = """
import os
from tutorial_lib.core import scratch_dir
from tutorial_lib.processes import _fork_context, stop_fork_server

folder = scratch_dir("fork-test-")
run = _fork_context().Process(target=os.getpid)  # starts the fork server, a child of the kernel
run.start(); run.join(); assert run.exitcode == 0
print(folder)
"""


@pytest.mark.slow
def test_a_kernel_that_used_the_fork_launcher_cleans_up_after_stop_fork_server():
    """The last cell of notebooks 11, 11a and 11b. A kernel shutting down waits for its child processes; with the fork
    server and the resource tracker still there it waits ~30 s, is killed first, and its scratch folder stays."""
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


@pytest.mark.slow
@pytest.mark.parametrize("killed", [False, True])
def test_a_forked_run_with_loader_workers_leaves_no_process_behind(tmp_path, killed):
    """A forked run's data loader workers must die with it, as under `python -m tutorial_lib.train`
    (they used to come from a second fork server that nobody stopped)."""
    data = make_image_folder(tmp_path / "data")
    options = dict(
        model="tinycnn",
        img_size=16,
        epochs=40 if killed else 3,
        batch_size=8,
        learning_rate=0.05,
        num_workers=2,
        cpu=True,
        log_with="none",
        disable_progress_bar=True,
        log_interval=0,
        path_to_data=str(data),
        working_directory=str(tmp_path / "runs"),
        experiment_name="run",
    )
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


PROBE = """
import os, sys
from pathlib import Path

def main(argv):
    import torch
    print(torch.get_num_threads(), os.environ.get("PROBE"), argv)
    if argv and argv[0] == "fill":
        Path(argv[1], "big").write_bytes(bytes(2_000_000))  # 2 MB onto a 1 MB disk
    return 7 if argv == ["status"] else None


if __name__ == "__main__":  # as the course's modules end
    sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def probe_module(tmp_path, monkeypatch):
    """A module `probe` with a `main(argv)`, importable by forked runs (they get this process's sys.path) and by
    `python -m probe` (through PYTHONPATH)."""
    (tmp_path / "probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return child_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), PROBE="yes")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["fork", "python"])
def test_a_run_gets_the_threads_environment_and_exit_status_it_would_get_from_python_m(probe_module, launcher):
    """A forked run used the fork server's thread count (its OMP_NUM_THREADS was read before the fork): two
    threads per run on a busy 2-core machine made every forked run about 10 times slower."""
    for threads in ("1", "2"):
        env = {**probe_module, "OMP_NUM_THREADS": threads}
        done = run_cli(["x"], launcher=launcher, module="probe", env=env, timeout=120)
        assert (done.returncode, done.stdout.strip()) == (0, f"{threads} yes ['x']"), done.stderr[-2000:]
    assert run_cli(["status"], launcher=launcher, module="probe", env=probe_module, timeout=120).returncode == 7


@pytest.mark.slow
@pytest.mark.skipif(can_mount_small_disk() is not None, reason="needs `unshare -rm` to mount a small tmpfs")
@pytest.mark.parametrize("launcher", ["fork", "python"])
def test_small_disk_gives_one_run_a_full_disk_that_nobody_else_sees(tmp_path, probe_module, launcher):
    disk = tmp_path / "disk"
    disk.mkdir()
    done = run_cli(
        ["fill", str(disk)], launcher=launcher, module="probe", env=probe_module, small_disk=(disk, "1M"), timeout=120
    )
    assert done.returncode == 1 and "No space left on device" in done.stderr, (done.returncode, done.stderr[-2000:])
    assert list(disk.iterdir()) == [], "the small disk is mounted for that run only"


def test_a_reused_workdir_is_refused_in_one_line_before_anything_runs(tmp_path, capsys):
    # the runs of an earlier stress test in --workdir used to end the reference run in a RuntimeError traceback
    from tutorial_lib.stress import main

    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "config.json").write_text("{}")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_:
        main(["resume", "--trials", "1", "--workdir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert f"--workdir {tmp_path} is not empty (the runs of an earlier stress test?)" in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "nothing written or removed"
