"""Signals and exit statuses on every launch path of `tutorial_lib.train` (notebooks 06b, 06c, 08b, 11, 11b).

SIGTERM to a one-process `accelerate launch` (plain subprocess or torchrun's agent), to a 2-process one and to a
process running `notebook_launcher` must reach the training, which checkpoints and stops, and the resumed run must
end bit-identical to one never stopped. Ctrl-C (SIGINT, sent as a terminal sends it: to every process of the
group) is the same polite stop with exit 130; a second one stops at once (notebook 11b's run of it is the check).
Under `accelerate launch`, which returns 1 for any failure, the script's own exit status (2, 3, 143) reaches
`$TUTORIAL_EXIT_STATUS_FILE` with one line from one process, and the SLURM script acts on that status. From
accelerate 1.16 on both of `accelerate launch`'s ways pass a signal on and return 128 + the signal; the one-process
one SIGKILLs 5 s later, so a run whose checkpoint cannot be saved in that time is refused at start (the tests name
the version where they differ).

A signal goes to a real `accelerate launch` process, or to a process that calls `notebook_launcher` as a notebook's
kernel does (forked from the library's fork server, 11a: like a kernel, it has imported torch and the library). The
runs whose weights are only compared (the straight runs, the resumed ones) are forked from that server too, two of
them joined as one gloo group: their numbers are those of the same run under `accelerate launch`, without its
start-up cost."""

import importlib.metadata
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
from packaging.version import Version
from train_helpers import CASE_RUN

from tutorial_lib.checkpoints import (
    incomplete_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    sha256_file,
    verify_checkpoint,
)
from tutorial_lib.cli import as_flags, config_path
from tutorial_lib.core import free_port
from tutorial_lib.launching import (
    ACCELERATE_KILL_AFTER_S,
    EXIT_STATUS_ENV,
    launch_with_timeout,
    launcher_name,
    read_exit_status,
    record_exit_status,
)
from tutorial_lib.processes import CliResult, TrainingProcess, _running, child_env, run_cli
from tutorial_lib.runs import StopAtOnce, StopRequest

ROOT = Path(__file__).resolve().parents[1]
# 6 optimizer steps per epoch on one process. The signal is sent once the first epoch is done; every run stops at
# step STOP (epoch 10), the straight ones and the resumed ones alike, and is compared there: 9 epochs of room for the
# signal to land in, and a 40-epoch schedule, so the learning rate still moves at every epoch.
STOP = 60
LONG = dict(CASE_RUN, epochs=40, stop_after_steps=STOP)
ONE_PROCESS = ("accelerate", "accelerate_1gpu")  # `--num_processes 1` (plain subprocess), 1gpu.yaml (torchrun's agent)
STOPPED = "checkpoint saved, resume with --resume_from_checkpoint latest"
# accelerate 1.16 changed both launchers: the one-process one passes a signal on and SIGKILLs 5 s later, and both
# return 128 + the signal (before: the one-process one died at once, torchrun's agent returned 1) (06c)
ACCELERATE_1_16 = Version(importlib.metadata.version("accelerate")) >= Version("1.16")


pytest_plugins = ("shared_runs",)  # small_data: built once per session


@pytest.fixture(scope="module")
def data(small_data) -> Path:
    """3 classes x 8 training and 2 validation JPEGs of 16 px (read only), the session's."""
    return small_data


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data) -> dict:
    """The weights of LONG at step STOP, never interrupted, on one process and on two."""
    work = tmp_path_factory.mktemp("straight")
    digests = {}
    for processes in (1, 2):
        name = f"p{processes}"
        run_forked(
            {**LONG, "path_to_data": data, "working_directory": work, "experiment_name": name}, work / name, processes
        )
        digests[processes] = weights_at_stop(work / name)
    return digests


def run_forked(options: dict, log_prefix: Path, processes: int) -> None:
    """Run the training command line with `options` to its end on `processes` processes forked from the fork server,
    two of them joined by the variables a launcher sets (rank, world size, rendezvous address) into one gloo group,
    as `accelerate launch --multi_gpu --num_processes 2` joins its two."""
    port, flags = str(free_port()), as_flags(options)
    group = {"WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1"}
    ranks = [
        TrainingProcess(
            flags,
            f"{log_prefix}.rank{rank}",
            "fork",
            env=child_env(**group, MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank)) if processes > 1 else None,
        )
        for rank in range(processes)
    ]
    for rank in ranks:
        done = rank.result(600)
        assert done.returncode == 0, done.stderr[-3000:]


def weights_at_stop(run_dir: Path) -> str:
    """The hash of the model's weights in the checkpoint a LONG run saves when it stops at step STOP."""
    return sha256_file(run_dir / "checkpoints" / f"step_{STOP:09d}" / "model.safetensors")


def start(tmp_path, data, name, launcher, options=LONG, env=None) -> TrainingProcess:
    flags = as_flags({**options, "path_to_data": data, "working_directory": tmp_path / "runs", "experiment_name": name})
    return TrainingProcess(flags, tmp_path / "logs" / name, launcher, env=env)


def wait_for_first_epoch(tmp_path, name, proc, timeout=240) -> None:
    metrics, deadline = tmp_path / "runs" / name / "metrics.jsonl", time.time() + timeout
    while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before its first epoch was done:\n{proc.result(10).stderr[-3000:]}"


def stopped_line(result: CliResult) -> str:
    lines = [line for line in result.stdout.splitlines() if line.startswith("stopped at optimizer step")]
    assert len(lines) == 1, f"expected one 'stopped at' line:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return lines[0]


def assert_checkpointed_and_resumes_identically(
    tmp_path, data, name, processes: int, stopped: CliResult, signame: str, expected_sha: str, options=LONG
) -> None:
    """The run stopped after a step it names, with a checkpoint of that step; resumed on as many processes (forked:
    what is checked is the checkpoint), it ends with `expected_sha`."""
    step = stopped_by_the_signal(stopped, signame)
    assert latest_checkpoint(tmp_path / "runs" / name).name == f"step_{step:09d}"
    assert not stopped.script_traceback, stopped.stderr[-3000:]
    resume(tmp_path, data, name, processes, options)
    assert weights_at_stop(tmp_path / "runs" / name) == expected_sha


def resume(tmp_path, data, name, processes: int, options=LONG) -> None:
    options = {**options, "path_to_data": data, "working_directory": tmp_path / "runs", "experiment_name": name}
    run_forked({**options, "resume_from_checkpoint": "latest"}, tmp_path / "logs" / f"{name}_resumed", processes)


def stopped_by_the_signal(stopped: CliResult, signame: str) -> int:
    """The step the run stopped at, which must be the signal's doing (before STOP), said in its one line."""
    line = stopped_line(stopped)
    assert f"({signame}): {STOPPED}" in line, line
    step = int(line.split()[4].rstrip(","))
    assert step < STOP, f"the signal landed after --stop_after_steps {STOP}: {line}"
    return step


# --- 5. SIGTERM reaches the training on every launch path -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ONE_PROCESS)
def test_sigterm_to_a_one_process_accelerate_launch_checkpoints_exits_143_and_resumes_identically(
    tmp_path, data, straight, launcher
):
    """Where the launcher does not SIGKILL its training 5 s after passing the SIGTERM on (torchrun's agent, `1gpu.yaml`,
    waits 30 s; accelerate's plain subprocess before 1.16 kills nothing), every checkpoint save takes SLOW_SAVE_S s,
    more than that: the run still ends with a complete checkpoint of the step it names. (Under accelerate's own
    one-process launcher from 1.16 on, such a run is refused at start: the next test.)"""
    slow = launcher == "accelerate_1gpu" or not ACCELERATE_1_16
    options = dict(LONG, save_checkpoint_interval=LONG["epochs"]) if slow else LONG  # no save before the stop's
    proc = start(tmp_path, data, "run", launcher, options, env=slow_save_env(tmp_path) if slow else None)
    wait_for_first_epoch(tmp_path, "run", proc)
    family = proc._list_family(every=0)
    assert family, "the launcher started a training process"
    sent = time.perf_counter()
    os.kill(proc.pid, signal.SIGTERM)  # what a scheduler sends: to the launcher
    while proc.launcher_returncode is None and time.perf_counter() - sent < 300:
        time.sleep(0.005)
    launcher_seconds, still_running = time.perf_counter() - sent, [p.pid for p in family.values() if _running(p)]
    stopped = proc.result(300)
    seconds = time.perf_counter() - sent  # until no process of the launch was left
    assert stopped.returncode == 143, (stopped.returncode, stopped.stderr[-3000:])  # the script's own status
    if ACCELERATE_1_16:  # both pass the signal on, wait for the training and return 128 + the signal
        assert stopped.launcher_returncode == 143 and not still_running, (stopped.launcher_returncode, still_running)
        if launcher == "accelerate":  # it SIGKILLs after 5 s: the training saved and exited before
            assert launcher_seconds < ACCELERATE_KILL_AFTER_S, launcher_seconds
    elif launcher == "accelerate":  # 1.0-1.15, a plain subprocess: the launcher dies at once, the training stops alone
        assert stopped.launcher_returncode == -signal.SIGTERM and launcher_seconds < 5, launcher_seconds
    else:  # 1.0-1.15, torchrun's agent passes the signal on, waits for the training to end and returns 1
        assert stopped.launcher_returncode == 1 and not still_running, still_running
    assert not [p.pid for p in family.values() if _running(p)], "a process of the launch was left running"
    if slow:  # the launch waited for the slow save, which was complete
        assert seconds > SLOW_SAVE_S, seconds
        step = stopped_by_the_signal(stopped, "SIGTERM")
        assert verify_checkpoint(latest_checkpoint(tmp_path / "runs" / "run"))["step"] == step
        assert not incomplete_checkpoints(tmp_path / "runs" / "run")
    assert_checkpointed_and_resumes_identically(tmp_path, data, "run", 1, stopped, "SIGTERM", straight[1], options)


# On PYTHONPATH of a test's training processes: every `Accelerator.save_state` sleeps $SLOW_SAVE_S first.
SLOW_SAVE_HOOK = textwrap.dedent("""
    import os
    import time

    from accelerate import Accelerator

    _save_state = Accelerator.save_state


    def save_state(self, *args, **kwargs):
        time.sleep(float(os.environ["SLOW_SAVE_S"]))
        return _save_state(self, *args, **kwargs)


    Accelerator.save_state = save_state
""")
SLOW_SAVE_S = ACCELERATE_KILL_AFTER_S + 1  # longer than the one-process launcher's time between SIGTERM and SIGKILL


def slow_save_env(tmp_path) -> dict:
    hook = tmp_path / "slow_save"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SAVE_HOOK)  # imported at the start of every Python of the launch
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    return child_env(PYTHONPATH=path, SLOW_SAVE_S=str(SLOW_SAVE_S))


@pytest.mark.slow
@pytest.mark.skipif(not ACCELERATE_1_16, reason="before 1.16 accelerate's one-process launcher kills nothing")
def test_a_save_slower_than_the_launchers_grace_is_refused_at_start(tmp_path, data):
    """Every checkpoint save takes SLOW_SAVE_S s, more than the 5 s between the SIGTERM that accelerate's (1.16 on)
    one-process launcher passes on and its SIGKILL. Under it the run is refused at start, in one line that says why
    and how to launch instead, with exit status 2 in the status file (the exit matrix's one-process refusal). (Under
    torchrun's agent, `1gpu.yaml`, and accelerate before 1.16, a SIGTERM to the launcher ends such a run with a
    complete checkpoint: the SIGTERM test's slow saves.)"""
    slow = dict(LONG, save_checkpoint_interval=LONG["epochs"])  # no save before the stop's
    flags = as_flags({**slow, "path_to_data": data, "working_directory": tmp_path / "runs", "experiment_name": "run"})
    refused = TrainingProcess(flags, tmp_path / "logs" / "run", "accelerate", env=slow_save_env(tmp_path)).result(300)
    errors = [text for text in refused.stderr_lines if text.startswith("tutorial-train:")]
    assert (refused.returncode, refused.launcher_returncode) == (2, 1), refused.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("tutorial-train: error: a checkpoint takes about "), errors
    # the exit status and its one line survive the launcher, as the exit matrix below asks of every failure
    assert not refused.script_traceback and "Connection closed" not in refused.stderr, refused.stderr[-3000:]
    assert "SIGKILLs the training 5 s after it passes a SIGTERM on" in errors[0] and "1gpu.yaml" in errors[0]
    timed = float(errors[0].split("takes about ")[1].split()[0])
    assert timed >= SLOW_SAVE_S, errors[0]  # the save it timed was the slow one
    assert not list_checkpoints(tmp_path / "runs" / "run") and not incomplete_checkpoints(tmp_path / "runs" / "run")
    assert not (tmp_path / "runs" / "run" / "metrics.jsonl").exists(), "refused before the first step"


@pytest.mark.slow
def test_sigterm_to_a_two_process_accelerate_launch_checkpoints_exits_143_and_resumes_identically(
    tmp_path, data, straight
):
    proc = start(tmp_path, data, "run", "accelerate_2proc")
    wait_for_first_epoch(tmp_path, "run", proc)
    proc.terminate(signal.SIGTERM, 300)
    stopped = proc.result(10)
    launcher_status = 143 if ACCELERATE_1_16 else 1  # torchrun's agent after passing the signal on
    assert (stopped.returncode, stopped.launcher_returncode) == (143, launcher_status), stopped.stderr[-3000:]
    manifest = verify_checkpoint(latest_checkpoint(tmp_path / "runs" / "run"))
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(manifest["files"]), "both processes saved their state"
    assert_checkpointed_and_resumes_identically(tmp_path, data, "run", 2, stopped, "SIGTERM", straight[2])


def notebook_launch(tmp_path, data, name, processes) -> TrainingProcess:
    """A process that calls `launch_with_timeout` on the training, as a notebook's cell does (tests/notebook_launch.py),
    forked from the fork server: like a notebook's kernel, it has imported torch and the library before."""
    options = {**LONG, "path_to_data": str(data), "working_directory": str(tmp_path / "runs"), "experiment_name": name}
    argv = [json.dumps(options), str(processes)]
    return TrainingProcess(argv, tmp_path / "logs" / name, "fork", module="notebook_launch")


@pytest.mark.slow
@pytest.mark.parametrize(  # by default SIGTERM to one process and Ctrl-C to two (the workers get it twice)
    "signum,processes",
    [
        pytest.param(signal.SIGTERM, 1, id="sigterm-1"),
        pytest.param(signal.SIGINT, 2, id="ctrl_c-2"),
        pytest.param(signal.SIGTERM, 2, id="sigterm-2", marks=pytest.mark.full_matrix),
        pytest.param(signal.SIGINT, 1, id="ctrl_c-1", marks=pytest.mark.full_matrix),
    ],
)
def test_a_signal_to_a_notebook_launcher_process_checkpoints_and_resumes_identically(
    tmp_path, data, straight, processes, signum
):
    """SIGTERM goes to the process that called `notebook_launcher`; Ctrl-C to its whole process group, as a terminal
    sends it (with 2 processes the workers then get it twice: from the terminal and from torch's agent)."""
    proc = notebook_launch(tmp_path, data, "nb", processes)
    wait_for_first_epoch(tmp_path, "nb", proc)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signal.SIGINT)  # the session it started: the process and its workers only
    else:
        os.kill(proc.pid, signum)
    stopped = proc.result(300)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 128 + signum, (stopped.returncode, output[-3000:])
    assert "Traceback" not in output, output[-3000:]
    step = stopped_by_the_signal(stopped, signal.Signals(signum).name)
    assert latest_checkpoint(tmp_path / "runs" / "nb").name == f"step_{step:09d}"
    resume(tmp_path, data, "nb", processes)
    assert weights_at_stop(tmp_path / "runs" / "nb") == straight[processes]


@pytest.mark.slow
def test_a_sigterm_while_a_finished_run_exits_ends_it_with_its_own_status(tmp_path, data):
    """The training is over and its status recorded; a SIGTERM now (a scheduler's, at the end of the job's time) to
    torchrun's agent (`1gpu.yaml`), which passes it on, has nothing to stop: the process finishes with status 0 instead
    of dying of the signal, which the agent would report as a failed launch with no status recorded. (The same
    signal to `python -m tutorial_lib.train` itself: tests/test_rerun_tools.py.)"""
    logs = tmp_path / "logs" / "run"
    status_file = Path(f"{logs}.status")  # where TrainingProcess points an accelerate launch's status too
    flags = as_flags(
        {**CASE_RUN, "path_to_data": data, "working_directory": tmp_path / "runs", "experiment_name": "run"}
    )
    proc = TrainingProcess(flags, logs, "accelerate_1gpu", env={**child_env(), EXIT_STATUS_ENV: str(status_file)})
    deadline = time.time() + 240
    while read_exit_status(status_file) is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.001)
    assert read_exit_status(status_file) == 0 and proc.poll() is None, proc.result(10).stderr[-3000:]
    os.kill(proc.pid, signal.SIGTERM)  # the process is on its way out: its status is written
    done = proc.result(120)
    assert done.returncode == 0, (done.returncode, done.launcher_returncode, done.stderr[-3000:])
    assert "stopped at optimizer step" not in done.stdout and not done.script_traceback, done.stderr[-3000:]
    assert (tmp_path / "runs" / "run" / "model.safetensors").exists()


@pytest.mark.slow
def test_launch_with_timeout_puts_back_the_signal_handlers_torchs_agent_installs(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    launch_with_timeout(os.getpid, (), num_processes=2, timeout=120)
    assert {s: signal.getsignal(s) for s in before} == before


# --- 6. exit statuses under `accelerate launch` --------------------------------------------------------------

CASES = {  # case -> (options, exit status, the one line's start)
    "bad flag": (dict(epochs=0), 2, "tutorial-train: error: --epochs must be >= 1, got 0"),
    "bad flag combination": (
        dict(lr_scheduler="cosine", lr_min=1),
        2,
        "tutorial-train: error: --lr_min 1 must be below",
    ),
    "nan loss": (
        dict(inject_nan_at_steps=[3]),
        3,
        "tutorial-train: error: the loss became NaN or Inf at optimizer step 3",
    ),
}


# By default: the failure during training (exit 3) under each launcher, a refused flag on two processes (both refuse,
# one says so) and the refused combination on one; --full-matrix adds the other pairs. From accelerate 1.16 on the
# refusal inside `train` on one process (exit 2, one line, no traceback of the script) is the slow save's, refused
# later, once the Accelerator is built: test_a_save_slower_than_the_launchers_grace_is_refused_at_start.
EXIT_MATRIX = [
    ("nan loss", "accelerate"),
    ("nan loss", "accelerate_1gpu"),
    ("nan loss", "accelerate_2proc"),
    ("bad flag", "accelerate_2proc"),
    *([] if ACCELERATE_1_16 else [("bad flag combination", "accelerate")]),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,launcher",
    [
        pytest.param(
            case,
            launcher,
            id=f"{case}-{launcher}",
            marks=() if (case, launcher) in EXIT_MATRIX else pytest.mark.full_matrix,
        )
        for case in CASES
        for launcher in [*ONE_PROCESS, "accelerate_2proc"]
    ],
)
def test_the_scripts_exit_status_and_one_line_survive_accelerate_launch(tmp_path, data, launcher, case):
    """`accelerate launch` returns 1 whatever failed (documented); the script's status reaches the status file, and
    its line is printed once, by one process, without a traceback of the script (the launcher adds its own)."""
    options, status, line = CASES[case]
    done = run_cli(
        as_flags(
            {
                **CASE_RUN,
                "epochs": 2,
                **options,
                "path_to_data": data,
                "working_directory": tmp_path / "runs",
                "experiment_name": "run",
            }
        ),
        launcher=launcher,
        timeout=300,
    )
    assert (done.returncode, done.launcher_returncode) == (status, 1), (done.returncode, done.stderr[-3000:])
    errors = [text for text in done.stderr_lines if text.startswith("tutorial-train:")]
    assert len(errors) == 1 and errors[0].startswith(line), errors
    assert not done.script_traceback and "Connection closed" not in done.stderr, done.stderr[-3000:]


def test_main_records_its_exit_status_for_job_scripts(tmp_path, monkeypatch):
    from tutorial_lib.train import main

    status_file = tmp_path / "status"
    monkeypatch.setenv(EXIT_STATUS_ENV, str(status_file))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["--epochs", "0"])  # refused by the parser, before anything is built
    assert exit_.value.code == 2 and read_exit_status(status_file) == 2


def test_main_keeps_its_late_signal_handlers_only_as_the_processs_own_command_line(tmp_path, monkeypatch):
    """`main()` (the process's command line) leaves `finish_despite_late_signals`'s handlers for the process's exit;
    `main(argv)` called from Python (a notebook, a test) puts the caller's handlers back."""
    from tutorial_lib.train import main

    monkeypatch.delenv("RANK", raising=False)
    names = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    before = {s: signal.getsignal(s) for s in names}
    argv = ["--path_to_data", str(tmp_path / "missing"), "--cpu", "--log_with", "none"]
    argv += ["--working_directory", str(tmp_path / "runs")]  # refused in `train`, after the handlers are installed
    try:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and {s: signal.getsignal(s) for s in names} == before
        monkeypatch.setattr(sys, "argv", ["tutorial-train", *argv])
        with pytest.raises(SystemExit) as exit_:
            main()
        kept = {s: getattr(signal.getsignal(s), "__qualname__", "") for s in names}
        assert exit_.value.code == 2 and all("finish_despite_late_signals" in q for q in kept.values()), kept
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_process_0s_recorded_status_wins_and_others_only_fill_an_empty_place(tmp_path, monkeypatch):
    status_file = tmp_path / "status"
    monkeypatch.setenv(EXIT_STATUS_ENV, str(status_file))
    monkeypatch.setenv("RANK", "1")
    record_exit_status(2)  # process 1 first: the place is empty
    record_exit_status(3)  # another of the others: the place is taken
    assert read_exit_status(status_file) == 2
    monkeypatch.setenv("RANK", "0")
    record_exit_status(143)
    assert read_exit_status(status_file) == 143 and sorted(p.name for p in tmp_path.iterdir()) == ["status"]
    monkeypatch.delenv(EXIT_STATUS_ENV)
    record_exit_status(0)  # nowhere to write: nothing happens
    assert read_exit_status(status_file) == 143 and read_exit_status(tmp_path / "none") is None


# --- the SLURM script acts on the training's own status ---------------------------------------------------------

STUBS = {  # stand-ins for SLURM's commands and for `accelerate`, which returns 1 whatever failed, as the real one
    "srun": '#!/bin/bash\nexport SLURM_NODEID=0\nexec "$@"\n',
    "scontrol": '#!/bin/bash\nif [ "$1" = show ]; then echo node0; echo node1; else echo "$@" >> "$SCONTROL_LOG"; fi\n',
    "accelerate": textwrap.dedent("""\
        #!/bin/bash
        echo "$@" > "$STUB_ARGS"
        case "$STUB_OUTCOME" in
          term) trap 'echo 143 > "$TUTORIAL_EXIT_STATUS_FILE"; exit 1' TERM
                touch "$STUB_READY"; while :; do sleep 0.05; done ;;
          crash) exit 1 ;;
          0) echo 0 > "$TUTORIAL_EXIT_STATUS_FILE"; exit 0 ;;
          *) echo "$STUB_OUTCOME" > "$TUTORIAL_EXIT_STATUS_FILE"; exit 1 ;;
        esac
        """),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "outcome, status, requeued",
    [("term", 143, True), ("2", 2, False), ("3", 3, False), ("0", 0, False), ("crash", 1, False)],
)
def test_the_slurm_script_requeues_only_a_run_stopped_with_a_checkpoint_and_exits_with_the_trainings_status(
    tmp_path, outcome, status, requeued
):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    stand_ins = dict(STUBS)
    if outcome != "term":  # the script's config lookup (a Python importing the library, ~2 CPU-s) runs in "term"
        stand_ins["python"] = f"#!/bin/bash\necho {config_path('2nodes_8gpus.yaml')}\n"
    for name, text in stand_ins.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    path = os.pathsep.join([str(stubs), str(Path(sys.executable).parent), os.environ["PATH"]])  # this Python first
    env = child_env(
        PATH=path,
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_NNODES="2",
        WORKDIR=str(tmp_path / "runs"),
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        STUB_OUTCOME=outcome,
        STUB_READY=str(tmp_path / "ready"),
        STUB_ARGS=str(tmp_path / "args"),
        PYTHONPATH=str(ROOT),
    )
    job = subprocess.Popen(
        ["bash", str(config_path("slurm_2nodes_8gpus.sbatch"))],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if outcome == "term":  # the time limit is near: SLURM sends SIGUSR1 to the batch script
        deadline = time.time() + 60
        while not (tmp_path / "ready").exists() and time.time() < deadline:
            time.sleep(0.02)
        job.send_signal(signal.SIGUSR1)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == status, (job.returncode, output)
    log = (tmp_path / "scontrol.log").read_text() if (tmp_path / "scontrol.log").exists() else ""
    assert log == ("requeue 4242\n" if requeued else ""), log
    args = (tmp_path / "args").read_text()
    assert f"launch --config_file {config_path('2nodes_8gpus.yaml')} " in args, args  # the shipped config, found
    assert "--resume_from_checkpoint latest" in args, args


# --- 10. Ctrl-C -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(  # by default the run with loader workers (forked) and the 2-process launch
    "launcher",
    [
        "fork",
        "accelerate_2proc",
        *(pytest.param(launcher, marks=pytest.mark.full_matrix) for launcher in ONE_PROCESS),
    ],
)
def test_ctrl_c_in_a_terminal_checkpoints_exits_130_with_one_line_and_resumes_identically(
    tmp_path, data, straight, launcher
):
    """Ctrl-C reaches every process of the terminal's foreground group: the launcher and its training process (with
    `fork`: the run and its two data loader workers). The run without a launcher is forked from the fork server: what
    is checked is the training's answer to Ctrl-C, which its workers, forked from it as from `python -m
    tutorial_lib.train`, get too; not a cold start."""
    options = dict(LONG, num_workers=2) if launcher == "fork" else LONG
    proc = start(tmp_path, data, "run", launcher, options)
    wait_for_first_epoch(tmp_path, "run", proc)
    proc.interrupt(300)
    stopped = proc.result(10)
    assert stopped.returncode == 130, (stopped.returncode, stopped.stderr[-3000:])
    said = [text for text in stopped.stderr_lines if text.startswith("Ctrl-C")]
    assert said == [
        "Ctrl-C: stopping after this optimizer step, with a checkpoint; press Ctrl-C again to stop at once, without one"
    ], stopped.stderr_lines
    if launcher == "fork":
        assert stopped.stderr_lines == said, "one line, no traceback"
    processes = 2 if launcher == "accelerate_2proc" else 1
    assert_checkpointed_and_resumes_identically(
        tmp_path, data, "run", processes, stopped, "SIGINT", straight[processes]
    )


def test_the_same_ctrl_c_twice_is_one_request_and_a_later_second_one_stops_at_once():
    one_process = types.SimpleNamespace(num_processes=1, is_main_process=False)  # not the main process: says nothing
    previous = signal.getsignal(signal.SIGINT)
    with StopRequest(one_process, same_press=0.5) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C from the terminal and from a launcher
        time.sleep(0.05)
        assert (stop.received, stop.requested(1), stop.exit_status) == ("SIGINT", True, 130)
        time.sleep(0.5)
        with pytest.raises(StopAtOnce):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)
        assert signal.getsignal(signal.SIGINT) == previous, "after a second Ctrl-C, a third one is Python's again"
    with StopRequest(one_process) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.received == "SIGTERM" and stop.exit_status == 143, "the first signal names the stop"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and signal.getsignal(signal.SIGINT) == previous


def _ctrl_c_in_a_forked_child() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)


@pytest.mark.slow
def test_a_forked_data_loader_worker_leaves_ctrl_c_to_its_parent():
    with StopRequest(types.SimpleNamespace(num_processes=1, is_main_process=False)) as stop:
        child = multiprocessing.get_context("fork").Process(target=_ctrl_c_in_a_forked_child)
        child.start()
        child.join(30)
    assert child.exitcode == 0 and stop.received is None


def test_only_accelerates_one_process_launcher_from_1_16_on_kills_5_s_after_a_sigterm(monkeypatch):
    from tutorial_lib import launching

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for parent in ("accelerate launch", "accelerate-launch", "accelerate.commands.launch"):
        monkeypatch.setattr(launching, "parent_launcher", lambda parent=parent: parent)
        assert launching.launcher_kill_after("1.16.0") == ACCELERATE_KILL_AFTER_S == 5
        assert launching.launcher_kill_after("1.15.0") is None, "before 1.16 it kills nothing"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's agent inside `accelerate launch` (1gpu.yaml)
    assert launching.launcher_kill_after("1.16.0") is None
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    for parent in ("torchrun", None):
        monkeypatch.setattr(launching, "parent_launcher", lambda parent=parent: parent)
        assert launching.launcher_kill_after("1.16.0") is None
    assert launching.check_save_fits_launcher(None, "unused", 0) is None, "nothing is timed then"


def test_launchers_are_recognised_by_their_command_line():
    assert (
        launcher_name(["/v/bin/python", "/v/bin/accelerate", "launch", "-m", "tutorial_lib.train"])
        == "accelerate launch"
    )
    assert launcher_name(["python", "-m", "accelerate.commands.launch", "x.py"]) == "accelerate.commands.launch"
    assert launcher_name(["/v/bin/python", "/v/bin/accelerate-launch", "x.py"]) == "accelerate-launch"
    assert launcher_name(["/v/bin/python", "/v/bin/torchrun", "--nproc_per_node", "2", "x.py"]) == "torchrun"
    assert launcher_name(["python", "-m", "torch.distributed.run", "x.py"]) == "torch.distributed.run"
    assert launcher_name(["/bin/bash"]) is None and launcher_name(["python", "-m", "ipykernel_launcher"]) is None


def test_the_default_stress_run_draws_ctrl_c_and_runs_its_last_trials_under_accelerate_launch():
    """`python -m tutorial_lib.stress resume --trials 10`: seeded plans (18 saves) with Ctrl-C kills beside SIGTERM and
    SIGKILL, and its last 3 trials under a one-process `accelerate launch`, of both kinds."""
    from tutorial_lib.stress import get_args_parser, trial_kill_plans

    kinds = [p.kind for t in range(10) for p in trial_kill_plans(0, t, 3, 18, 1.5)]
    assert kinds.count("sigint") >= 2 and kinds.count("sigterm") >= 5 and kinds.count("during_save") >= 10, kinds
    args = get_args_parser().parse_args(["resume"])
    assert (args.trials, args.accelerate_trials) == (10, 3)
