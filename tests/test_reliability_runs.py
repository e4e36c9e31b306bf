"""Run folders, resumes and flags that must not take a run over or fail late (notebook 11b).

Every case runs the real command line in its own process (`run_cli`, forked) and must do what the user meant or stop
with exactly one line on stderr (exit 2) before anything is written: run names that leave the working directory, a
resume of another run's checkpoint into a folder holding a run, a folder whose `config.json` is damaged or missing,
image sizes the model cannot take, W&B online without a key or without a network, a disk too small for a checkpoint,
`~` in path flags, derived defaults named as derived, and crafted checkpoints."""

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_helpers import CASE_RUN, assert_user_error

from tutorial_lib.checkpoints import MANIFEST, latest_checkpoint, list_checkpoints, sha256_file
from tutorial_lib.cli import as_flags
from tutorial_lib.core import free_port
from tutorial_lib.processes import CliResult, can_mount_small_disk, child_env, run_cli

# a test that starts processes or trains is marked slow (skipped by `pytest -m "not slow"`): the conftest checks it

TINY = CASE_RUN  # one epoch of tinycnn, batch 4 (train_helpers)
FRESH_RUN_REFUSAL = (
    "already holds a run (checkpoints, metrics.jsonl, model.safetensors, final_metrics.json): resume "
    "it with --resume_from_checkpoint latest, give this run another --experiment_name, or pass "
    "--overwrite to move the old run aside (nothing is deleted)"
)

pytest_plugins = ("shared_runs",)  # data, finished_tiny_run: built once per session


@pytest.fixture
def run_a(finished_tiny_run) -> Path:
    """A finished tinycnn run ("run A") with mid-epoch checkpoints: the other run of the takeover cases."""
    return finished_tiny_run


def cli(tmp_path, data, name="run", launcher="fork", env=None, timeout=180, **options) -> CliResult:
    flags = {**TINY, "path_to_data": data, "working_directory": tmp_path / "runs", "experiment_name": name, **options}
    return run_cli(as_flags(flags), launcher=launcher, env=env, timeout=timeout)


def files_of(folder: Path) -> dict:
    """Every file under `folder` (the lock file aside) with its SHA-256: a run left exactly as it was compares equal."""
    return {
        p.relative_to(folder): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".run.lock"
    }


def run_id_of(run_dir: Path) -> str:
    return json.loads((run_dir / "config.json").read_text())["run_id"]


def assert_one_line_error(result: CliResult, start: str, code: int = 2) -> str:
    """Like `assert_user_error` for a message that ends with a library's own words: exit `code`, one line starting
    `tutorial-train: error: <start>`, no traceback. Returns the line."""
    assert not result.has_traceback, f"a traceback was printed:\n{result.stderr[-2000:]}"
    assert result.returncode == code, (
        f"exit code {result.returncode}, expected {code}; stderr:\n{result.stderr[-2000:]}"
    )
    assert len(result.stderr_lines) == 1 and result.stderr_lines[0].startswith(f"tutorial-train: error: {start}"), (
        "\n".join(result.stderr_lines)
    )
    return result.stderr_lines[0]


# --- 3. the run's name stays inside the working directory --------------------------------------------------

LEAVE = "name a folder inside it, e.g. --experiment_name resnet50_v1"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, message",
    [
        (
            "",
            f"--experiment_name '' is empty: the run's files would go into --working_directory itself, among its other "
            f"runs; {LEAVE}",
        ),
        (".", f"--experiment_name '.' names --working_directory itself, where the other runs are; {LEAVE}"),
        ("a/..", f"--experiment_name 'a/..' names --working_directory itself, where the other runs are; {LEAVE}"),
        (
            "..",
            f"--experiment_name '..' leads out of --working_directory (to ..); {LEAVE}, or choose another "
            "--working_directory",
        ),
        (
            "../../X",
            f"--experiment_name '../../X' leads out of --working_directory (to ../../X); {LEAVE}, or choose "
            "another --working_directory",
        ),
        (
            "a/../../X",
            f"--experiment_name 'a/../../X' leads out of --working_directory (to ../X); {LEAVE}, or choose "
            "another --working_directory",
        ),
        (
            "/ABS/X",
            "--experiment_name '/ABS/X' is an absolute path, but the run folder is <working_directory>/"
            "<experiment_name>: pass the parent folder as --working_directory and the last part as --experiment_name",
        ),
    ],
)
def test_run_names_that_are_or_leave_the_working_directory_are_refused_before_anything_is_written(
    tmp_path, data, name, message
):
    work = tmp_path / "deep" / "er" / "runs"
    work.mkdir(parents=True)
    (work / "other_run").mkdir()
    (work / "other_run" / "metrics.jsonl").write_text('{"epoch": 0}\n')  # another run, which --overwrite must not move
    name = name.replace("/ABS", str(tmp_path / "abs"))
    message = message.replace("/ABS", str(tmp_path / "abs"))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for overwrite in (False, True):
        done = run_cli(
            as_flags(
                {
                    **TINY,
                    "path_to_data": data,
                    "working_directory": work,
                    "experiment_name": name,
                    "overwrite": overwrite,
                }
            )
        )
        assert_user_error(done, message)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "nothing may be written"


@pytest.mark.slow
def test_a_run_name_with_subfolders_is_normalised_and_stays_inside(tmp_path, data):
    done = cli(tmp_path, data, name="group/./one/")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "runs" / "group" / "one" / "model.safetensors").is_file()
    assert (
        json.loads((tmp_path / "runs" / "group" / "one" / "config.json").read_text())["experiment_name"] == "group/one"
    )


# --- 4. another run's checkpoint, resumed into a folder that holds a run ----------------------------------------


@pytest.mark.slow
def test_resuming_another_runs_checkpoint_into_a_folder_holding_a_run_is_refused_and_changes_nothing(
    tmp_path, data, run_a
):
    b = cli(tmp_path, data, name="b", checkpoint_every_steps=2)
    assert b.returncode == 0, b.stderr
    run_b = tmp_path / "runs" / "b"
    a_before, b_before = files_of(run_a), files_of(run_b)
    done = cli(tmp_path, data, name="b", epochs=2, resume_from_checkpoint=latest_checkpoint(run_a))
    assert_user_error(done, f"{run_b} {FRESH_RUN_REFUSAL}")
    assert files_of(run_b) == b_before and files_of(run_a) == a_before, "both runs must be left exactly as they were"
    # the first way out the line names: resume the folder's own run
    b_checkpoint, b_id = latest_checkpoint(run_b), run_id_of(run_b)
    own = cli(tmp_path, data, name="b", epochs=2, resume_from_checkpoint="latest")
    assert own.returncode == 0 and f"resumed from {b_checkpoint}:" in own.stdout, own.stderr
    assert run_id_of(run_b) == b_id != run_id_of(run_a)


@pytest.mark.slow
def test_another_runs_checkpoint_resumes_into_a_new_folder_and_leaves_it_untouched(tmp_path, data, run_a):
    a_before = files_of(run_a)
    checkpoint = list_checkpoints(run_a)[0]
    done = cli(tmp_path, data, name="fork_of_a", epochs=2, resume_from_checkpoint=checkpoint)
    assert done.returncode == 0, done.stderr
    assert f"resumed from {checkpoint}:" in done.stdout
    assert files_of(run_a) == a_before, "the run the checkpoint came from must be untouched"
    assert run_id_of(tmp_path / "runs" / "fork_of_a") == run_id_of(run_a), "it continues run A's id, in its own folder"


@pytest.mark.slow
def test_overwrite_moves_the_folders_run_aside_to_resume_another_runs_checkpoint(tmp_path, data, run_a):
    b = cli(tmp_path, data, name="b")
    assert b.returncode == 0, b.stderr
    run_b = tmp_path / "runs" / "b"
    b_weights = sha256_file(run_b / "model.safetensors")
    checkpoint = list_checkpoints(run_a)[0]
    done = cli(tmp_path, data, name="b", epochs=2, resume_from_checkpoint=checkpoint, overwrite=True)
    assert done.returncode == 0, done.stderr
    aside = [p for p in run_b.parent.iterdir() if p.name.startswith("b.replaced-")]
    assert len(aside) == 1 and sha256_file(aside[0] / "model.safetensors") == b_weights, "B moved aside, not deleted"
    assert run_id_of(run_b) == run_id_of(run_a) and f"resumed from {checkpoint}:" in done.stdout
    # a checkpoint inside the folder itself cannot survive the move: that stays refused
    inside = cli(tmp_path, data, name="b", epochs=2, resume_from_checkpoint=latest_checkpoint(run_b), overwrite=True)
    assert_user_error(
        inside,
        "--overwrite moves the run in the folder aside and starts a new one; "
        "--resume_from_checkpoint continues it: give one of them",
    )


@pytest.mark.slow
def test_latest_in_a_folder_without_config_json_never_adopts_a_foreign_checkpoint(tmp_path, data, run_a):
    b = cli(tmp_path, data, name="b", checkpoint_every_steps=2)
    assert b.returncode == 0, b.stderr
    run_b = tmp_path / "runs" / "b"
    own, foreign = latest_checkpoint(run_b), latest_checkpoint(run_a)
    assert int(foreign.name[5:]) > int(own.name[5:]), "the foreign checkpoint must be the newer one"
    shutil.copytree(foreign, run_b / "checkpoints" / foreign.name)
    (run_b / "config.json").unlink()
    before = files_of(run_b)
    done = cli(tmp_path, data, name="b", epochs=3, resume_from_checkpoint="latest")
    ids = sorted({run_id_of(run_a), json.loads((own / MANIFEST).read_text())["run_id"]})
    assert_user_error(
        done,
        f"{run_b} has no config.json to say which run it belongs to, and its checkpoints belong to "
        f"2 runs ({', '.join(ids)}): move the other runs' checkpoints out of {run_b / 'checkpoints'}, "
        "or resume one of them into a new folder with --resume_from_checkpoint <its folder> "
        "--experiment_name <a new name>",
    )
    assert files_of(run_b) == before
    shutil.rmtree(run_b / "checkpoints" / foreign.name)  # the way out: then its own checkpoints say whose it is
    resumed = cli(tmp_path, data, name="b", epochs=3, resume_from_checkpoint="latest")
    assert resumed.returncode == 0 and f"resumed from {own}:" in resumed.stdout, resumed.stderr


@pytest.mark.slow
def test_latest_refuses_a_config_json_that_names_a_run_whose_checkpoints_are_not_there(tmp_path, data):
    # it used to start from scratch (warnings only) and replace the checkpoints and metrics of the run they belong to
    b = cli(tmp_path, data, name="b", checkpoint_every_steps=2)
    assert b.returncode == 0, b.stderr
    run_b = tmp_path / "runs" / "b"
    own = run_id_of(run_b)
    config = json.loads((run_b / "config.json").read_text())
    (run_b / "config.json").write_text(json.dumps({**config, "run_id": "someone-else"}))  # another run's file
    before = files_of(run_b)
    done = cli(tmp_path, data, name="b", epochs=3, resume_from_checkpoint="latest")
    assert_user_error(
        done,
        f"{run_b / 'config.json'} names run someone-else, but the checkpoints in {run_b / 'checkpoints'} belong to "
        f"{own}: put back that run's config.json, or move this one aside (the run's id is then read from its "
        "checkpoints) and run the same command again",
    )
    assert files_of(run_b) == before
    (run_b / "config.json").rename(run_b / "config.json.other")  # the way out the line gives
    resumed = cli(tmp_path, data, name="b", epochs=3, resume_from_checkpoint="latest")
    assert resumed.returncode == 0 and f"resumed from {run_b / 'checkpoints'}/step_" in resumed.stdout, resumed.stderr
    assert run_id_of(run_b) == own, "the run continued is the one the checkpoints belong to"


# --- 8. a damaged config.json on resume ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage, problem",
    [
        (
            lambda text: text[:2],
            "not JSON: Expecting property name enclosed in double quotes: line 2 column 1 (char 2)",
        ),
        (lambda text: "\x00\x01garbage", "not JSON: Expecting value: line 1 column 1 (char 0)"),
        (lambda text: "[1, 2]", "not a JSON object"),
        (lambda text: '{"experiment_name": "b"}', "it names no run_id"),
    ],
)
def test_a_damaged_config_json_is_one_line_naming_it_and_the_checkpoints_still_resume(tmp_path, data, damage, problem):
    assert cli(tmp_path, data, name="b", checkpoint_every_steps=2).returncode == 0
    run_b = tmp_path / "runs" / "b"
    config = run_b / "config.json"
    run_id = run_id_of(run_b)
    config.write_text(damage(config.read_text()))
    done = cli(tmp_path, data, name="b", epochs=2, resume_from_checkpoint="latest")
    assert_user_error(
        done,
        f"{config} is damaged ({problem}); the checkpoints are still usable: move the file aside "
        "(e.g. to config.json.damaged) and run the same command again, which reads the run's id from "
        "its checkpoints",
    )
    config.rename(run_b / "config.json.damaged")  # the way out the line names
    last = latest_checkpoint(run_b)
    resumed = cli(tmp_path, data, name="b", epochs=2, resume_from_checkpoint="latest")
    assert resumed.returncode == 0 and f"resumed from {last}:" in resumed.stdout, resumed.stderr
    assert run_id_of(run_b) == run_id, "the run keeps its id"


# --- 7. image sizes the model cannot take ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "options, flag, size",
    [
        (dict(img_size=1), "--img_size", 1),
        (dict(img_size=2), "--img_size", 2),
        (dict(img_size=3), "--img_size", 3),
        (dict(val_img_size=1), "--val_img_size", 1),
        (dict(val_img_size=3), "--val_img_size", 3),
    ],
)
def test_image_sizes_the_model_cannot_take_are_refused_before_any_data_is_read(
    tmp_path, options, flag, size, monkeypatch
):
    from tutorial_lib import flags
    from tutorial_lib import train as T

    monkeypatch.setattr(T, "load_data", lambda args: pytest.fail("the data was read before the sizes were checked"))
    with pytest.raises(
        flags.BadFlagError,
        match=re.escape(f"{flag} {size} is too small for --model tinycnn: the smallest image it accepts is 4 px"),
    ):
        T.train(
            flags.default_args(
                **{**TINY, "path_to_data": str(tmp_path), "working_directory": str(tmp_path / "runs"), **options}
            )
        )
    done = cli(tmp_path, tmp_path / "nowhere", **options)  # the command line: one line, before the data is looked at
    assert_one_line_error(
        done, f"{flag} {size} is too small for --model tinycnn: the smallest image it accepts is 4 px (at {size} px: "
    )


@pytest.mark.slow
def test_the_smallest_size_is_the_models_own_and_right(tmp_path, data):
    """Computed from the model, not a table: checked against real forward passes on the CPU for two models."""
    from tutorial_lib.flags import build_model, meta_model, smallest_input_size

    for name, size in [("tinycnn", 4), ("squeezenet1_0", None)]:
        smallest = smallest_input_size(meta_model(name))
        assert size is None or smallest == size
        real = build_model(name, 3).eval()
        with torch.no_grad():
            real(torch.zeros(2, 3, smallest, smallest))  # the smallest works ...
            with pytest.raises(RuntimeError):
                real(torch.zeros(2, 3, smallest - 1, smallest - 1))  # ... one pixel less does not
    done = cli(tmp_path, data, model="squeezenet1_0", img_size=16)
    assert_one_line_error(
        done,
        f"--img_size 16 is too small for --model squeezenet1_0: the smallest image it accepts "
        f"is {smallest_input_size(meta_model('squeezenet1_0'))} px (at 16 px: ",
    )
    assert cli(tmp_path, data, img_size=4, name="four").returncode == 0, "4 px trains"


# --- 9. W&B online without a key, or without a network --------------------------------------------------------


def no_network_env(tmp_path: Path, **extra) -> dict:
    """No ~/.netrc, and every address W&B could use is a closed port on this machine: no packet leaves it."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    closed = f"http://127.0.0.1:{free_port()}"
    return child_env(
        **{
            "HOME": str(home),
            "NETRC": str(home / ".netrc"),
            "WANDB_MODE": None,
            "WANDB_API_KEY": None,
            "WANDB_BASE_URL": closed,
            "HTTPS_PROXY": closed,
            "HTTP_PROXY": closed,
            **extra,
        }
    )


@pytest.mark.slow
def test_wandb_online_without_a_key_is_refused_at_start(tmp_path, data):
    env = no_network_env(tmp_path, WANDB_MODE="online")
    baseline = cli(tmp_path, data, learning_rate=0, env=env)  # a flag refused at start: the same start-up cost
    done = cli(tmp_path, data, log_with="wandb", env=env, timeout=60)
    assert_user_error(
        done,
        "WANDB_MODE=online but W&B has no API key here (WANDB_API_KEY or `wandb login`): log in, "
        "or unset WANDB_MODE to log offline and upload later with `wandb sync`",
    )
    assert done.seconds - baseline.seconds < 5, f"{done.seconds:.1f} s against {baseline.seconds:.1f} s"
    assert not (tmp_path / "runs" / "run").exists(), "refused before anything was written"


@pytest.mark.slow
def test_wandb_with_a_key_and_no_network_falls_back_to_offline_and_says_so_within_seconds(tmp_path, data):
    """Against the same run offline without a key (W&B's own start-up, seconds on a busy machine, is in both): the
    missing network adds less than 5 s, where `wandb.init` online would wait about 90 s and fail."""
    env = no_network_env(tmp_path, WANDB_API_KEY="0123456789" * 4)
    url = env["WANDB_BASE_URL"]
    offline = cli(
        tmp_path, data, name="no_key", log_with="wandb", env={k: v for k, v in env.items() if k != "WANDB_API_KEY"}
    )
    online = cli(tmp_path, data, name="wb", log_with="wandb", env=env, timeout=60)
    assert offline.returncode == 0 and "W&B: no API key found" in offline.stdout, offline.stderr[-3000:]
    assert online.returncode == 0 and not online.killed, online.stderr[-3000:]
    logs = tmp_path / "runs" / "wb" / "wandb"
    assert (
        f"W&B: {url} does not answer ([Errno 111] Connection refused), logging offline to {logs}; metrics.jsonl has "
        f"every epoch; upload later with `wandb sync {logs}/offline-run-*`"
    ) in online.stdout.splitlines()
    assert list(logs.glob("offline-run-*")), "no offline W&B run was written"
    assert online.seconds - offline.seconds < 5, f"the missing network added {online.seconds - offline.seconds:.1f} s"


@pytest.mark.slow
def test_an_unknown_wandb_mode_is_one_line_at_start(tmp_path, data):
    done = cli(tmp_path, data, log_with="wandb", env=no_network_env(tmp_path, WANDB_MODE="onlin"))
    assert_user_error(
        done, "WANDB_MODE='onlin' is not one of ('online', 'offline', 'disabled'); set it to one of those or unset it."
    )


# --- low: disk space, derived defaults, ~, library warnings, crafted checkpoints ---------------------------------


@pytest.mark.slow
@pytest.mark.skipif(can_mount_small_disk() is not None, reason="needs `unshare -rm` to mount a small tmpfs")
def test_a_disk_too_small_for_one_checkpoint_is_refused_at_start_in_sensible_units(tmp_path, data):
    disk = tmp_path / "disk"
    disk.mkdir()
    done = run_cli(
        as_flags({**TINY, "path_to_data": data, "working_directory": disk, "experiment_name": "small"}),
        small_disk=(disk, "150k"),
    )
    line = assert_one_line_error(
        done, f"not enough space on the disk of {disk / 'small'} for a checkpoint: it needs about "
    )
    assert re.fullmatch(
        r".*it needs about 2\d\d\.\d kB, 1\d\d\.\d kB are free; free some space or choose another "
        r"--working_directory",
        line,
    ), line
    assert "epoch" not in done.stdout, "refused before the first epoch"


@pytest.mark.slow
@pytest.mark.skipif(can_mount_small_disk() is not None, reason="needs `unshare -rm` to mount a small tmpfs")
def test_a_disk_that_fills_at_the_final_save_is_one_line_in_sensible_units(tmp_path, data):
    """300 KB: room for the estimate (about 250 KB) and the one checkpoint (about 210 KB), not for
    model.safetensors after it (93 KB): the save of the final weights finds the disk full."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = run_cli(
        as_flags({**TINY, "path_to_data": data, "working_directory": disk, "experiment_name": "full"}),
        small_disk=(disk, "300k"),
    )
    line = assert_one_line_error(
        done, f"no space left on the disk of {disk / 'full'} while saving the final model: it needs about 95.1 kB, "
    )
    assert re.fullmatch(
        r".*needs about 95\.1 kB, \d+(\.\d+)? kB are free; .*\(from step_000000006, which is intact\)", line
    )


def test_the_derived_warmup_is_capped_in_a_short_run_and_said(tmp_path):
    from tutorial_lib.flags import check_args, default_args, resolve_learning_rate

    args = resolve_learning_rate(default_args(batch_size=1024, epochs=1, working_directory=str(tmp_path)), 1)
    assert args.lr_warmup_epochs == 0.25 and args.lr_warmup_derived
    assert (
        "warmup 0.25 epochs (the rule's 5 x (1 - 256 / 1024) = 3.75, capped at 25% of the 1-epoch run)" in args.lr_rule
    )
    check_args(args)  # no "covers the whole run" for a value the user never gave
    long = resolve_learning_rate(default_args(batch_size=1024, epochs=90), 1)
    assert long.lr_warmup_epochs == 3.75 and "capped" not in long.lr_rule, "a long run keeps the rule's warmup"
    given = resolve_learning_rate(default_args(batch_size=1024, epochs=1, lr_warmup_epochs=0.8), 1)
    assert given.lr_warmup_epochs == 0.8 and not given.lr_warmup_derived, "a given warmup is never changed"


@pytest.mark.slow
@pytest.mark.parametrize(
    "options, message",
    [
        (
            dict(lr_scheduler="onecycle", learning_rate=None),
            "--lr_scheduler onecycle rises during the warmup, but the warmup derived from the global batch is "
            "0 epochs (5 x (1 - 256 / global batch), none up to 256): give --lr_warmup_epochs, more than 0 and at "
            "most half the run (e.g. --lr_warmup_epochs 0.3)",
        ),
        (
            dict(lr_scheduler="cosine", lr_min=0.01, learning_rate=None),
            "--lr_min 0.01 must be below the learning rate derived from the global batch (lr 0.001563 = 0.1 x 4 / 256; "
            "--learning_rate not given): the cosine schedule decays from the learning rate down to it",
        ),
    ],
)
def test_errors_about_derived_values_say_they_were_derived(tmp_path, options, message):
    assert_user_error(cli(tmp_path, tmp_path / "nowhere", **options), message)


@pytest.mark.slow
def test_tilde_is_expanded_in_every_path_flag(tmp_path, data):
    home = tmp_path / "home"
    shutil.copytree(data, home / "data")
    env, flags = child_env(HOME=str(home)), {**TINY, "epochs": 2, "stop_after_steps": 6}
    first = run_cli(
        as_flags(flags) + ["--path_to_data=~/data", "--working_directory=~/runs", "--experiment_name", "t"],
        env=env,
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    checkpoint = latest_checkpoint(home / "runs" / "t")
    tilde = f"~/runs/t/checkpoints/{checkpoint.name}"
    resumed = run_cli(
        as_flags({**flags, "stop_after_steps": None})
        + [
            "--path_to_data",
            "~/data",
            "--working_directory",
            "~/runs",
            "--experiment_name",
            "t",
            "--resume_from_checkpoint",
            tilde,
        ],
        env=env,
        cwd=tmp_path,
    )
    assert resumed.returncode == 0 and f"resumed from {checkpoint}:" in resumed.stdout, resumed.stderr
    assert (home / "runs" / "t" / "model.safetensors").is_file()
    assert not (tmp_path / "~").exists(), "no folder named ~ in the working directory"
    config = json.loads((home / "runs" / "t" / "config.json").read_text())
    assert config["working_directory"] == str(home / "runs") and config["path_to_data"] == str(home / "data")


def crafted(tmp_path: Path, run_a: Path, file_name: str, change) -> Path:
    """A copy of run A (as run "run") whose latest checkpoint's `file_name` is rewritten by `change(path)`, the manifest
    updated to match, as a careful forger would: only the loader can tell."""
    run = Path(shutil.copytree(run_a, tmp_path / "runs" / "run"))
    checkpoint = latest_checkpoint(run)
    change(checkpoint / file_name)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][file_name] = {
        "bytes": (checkpoint / file_name).stat().st_size,
        "sha256": sha256_file(checkpoint / file_name),
    }
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    return checkpoint


def plain_pickle(path: Path) -> None:
    path.write_bytes(pickle.dumps({"state": {}, "param_groups": []}, protocol=4))


@pytest.mark.slow
def test_a_library_warning_never_comes_before_the_one_line(tmp_path, data, run_a):
    """A plain pickle (protocol 4, not torch's) makes torch warn as it refuses it: the user sees our line only."""
    checkpoint = crafted(tmp_path, run_a, "optimizer.bin", plain_pickle)
    assert_user_error(
        cli(tmp_path, data, epochs=3, resume_from_checkpoint="latest"),
        f"--resume_from_checkpoint {checkpoint}: optimizer.bin holds more than tensors and numbers "
        "(UnpicklingError); torch.load(weights_only=True) refused it and nothing was run: only resume "
        "from checkpoints you wrote",
    )


def _model_tensor_grown(path):
    weights = load_file(path)
    weights["0.bias"] = torch.zeros(17)
    save_file(weights, path, metadata={"format": "pt"})


def _momentum_of_another_shape(path):
    state = torch.load(path, weights_only=True)
    state["state"][0]["momentum_buffer"] = torch.zeros(3)
    torch.save(state, path)


def _one_group_less(path):
    state = torch.load(path, weights_only=True)
    state["param_groups"] = state["param_groups"][:1]
    torch.save(state, path)


def _progress(change):
    def rewrite(path):
        state = json.loads(path.read_text())
        change(state)
        path.write_text(json.dumps(state))

    return rewrite


ANOTHER = "it was not written by this script for this model: resume from a checkpoint of this run"


@pytest.mark.slow
@pytest.mark.parametrize(
    "file_name, change, message",
    [
        (
            "model.safetensors",
            _model_tensor_grown,
            f"model.safetensors holds 0.bias of shape [17], this model's is [16]; {ANOTHER}",
        ),
        (
            "optimizer.bin",
            _momentum_of_another_shape,
            f"optimizer.bin holds a momentum_buffer of shape [3] for a parameter of shape [16, 3, 3, 3]; {ANOTHER}",
        ),
        (
            "optimizer.bin",
            _one_group_less,
            f"optimizer.bin has parameter groups of [4] parameters, this run's optimizer [4, 4]; {ANOTHER}",
        ),
        (
            "train_state.json",
            _progress(lambda s: (s.pop("global_step"), s.update(evil=1))),
            "train_state.json is not this script's (missing ['global_step'], unexpected ['evil']); "
            "resume from a checkpoint of this run",
        ),
        (
            "train_state.json",
            _progress(lambda s: s.update(epoch="one")),
            "train_state.json is not this script's (epoch is 'one', expected a non-negative integer); "
            "resume from a checkpoint of this run",
        ),
        (
            "train_state.json",
            _progress(lambda s: s.update(layout={"processes": 1})),
            "train_state.json is not this script's (layout is {'processes': 1}, expected a list); "
            "resume from a checkpoint of this run",
        ),
        (
            "train_state.json",
            lambda path: path.write_text('{"epoch": 1,'),
            "train_state.json is unreadable "
            "(Expecting property name enclosed in double quotes: line 1 column 13 (char 12)); "
            "resume from another checkpoint",
        ),
    ],
)
def test_a_crafted_checkpoint_whose_manifest_matches_is_refused_in_one_line(
    tmp_path, data, run_a, file_name, change, message
):
    checkpoint = crafted(tmp_path, run_a, file_name, change)
    assert_user_error(
        cli(tmp_path, data, epochs=3, resume_from_checkpoint="latest"),
        f"--resume_from_checkpoint {checkpoint}: {message}",
    )


def test_a_checkpoint_that_cannot_fit_is_a_disk_full_error_naming_the_working_directory(tmp_path):
    from tutorial_lib.checkpoints import DiskFullError
    from tutorial_lib.runs import check_checkpoint_space

    free = shutil.disk_usage(tmp_path).free
    check_checkpoint_space(tmp_path, need=1)
    with pytest.raises(DiskFullError, match=r"for a checkpoint: it needs about .* choose another --working_directory"):
        check_checkpoint_space(tmp_path, need=2 * free)
