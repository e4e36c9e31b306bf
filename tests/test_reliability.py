"""Reliability and security of `tutorial_lib.train` (notebooks 11 and 11b).

Every bad input is run through the real command line in its own process (forked from a server that
imported the library once, so 20 cases cost seconds; two cases also through `python -m
tutorial_lib.train`) and must exit 2 with exactly one line on stderr and no traceback. Also: safe
loading (a planted pickle payload is refused and never runs), atomic checkpoints, the NaN/Inf guard,
W&B without credentials or network; one run per folder, resumes that do what the command line says, flag checks
before any data is read, SIGTERM, and a full disk. (A dying worker in a 2-process launch is notebook 11's check.)"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torchvision
from train_helpers import CASE_RUN, assert_user_error

from tutorial_lib.checkpoints import (
    MANIFEST,
    incomplete_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    sha256_file,
    verify_checkpoint,
)
from tutorial_lib.cli import as_flags
from tutorial_lib.processes import (
    CliResult,
    TrainingProcess,
    child_env,
    corrupt_image,
    run_cli,
)
from tutorial_lib.sources import IMG_EXTENSIONS

# a test that starts processes or trains is marked slow (skipped by `pytest -m "not slow"`): the conftest checks it

ROOT = Path(__file__).resolve().parents[1]
TINY = CASE_RUN  # one epoch of tinycnn, batch 4 (train_helpers)

pytest_plugins = ("shared_runs",)  # data, finished_tiny_run: built once per session


@pytest.fixture
def finished_run(finished_tiny_run) -> Path:
    """A completed tinycnn run with mid-epoch checkpoints (the source of the checkpoint cases)."""
    return finished_tiny_run


def cli(tmp_path, data, launcher="fork", **options):
    flags = {**TINY, "path_to_data": data, "working_directory": tmp_path / "runs", "experiment_name": "bad", **options}
    return run_cli(as_flags(flags), launcher=launcher, timeout=180)


def copy_data(data: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(data, tmp_path / "data"))


# --- bad inputs: exit 2, one line, no traceback --------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, value, shown",
    [
        ("learning_rate", 0, "0.0"),
        ("learning_rate", -0.1, "-0.1"),
        ("learning_rate", "nan", "nan"),
    ],
)
def test_non_positive_or_nan_learning_rate_is_refused(tmp_path, data, flag, value, shown):
    assert_user_error(cli(tmp_path, data, **{flag: value}), f"--learning_rate must be a positive number, got {shown}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, value",
    [("batch_size", 0), ("batch_size", -8), ("epochs", 0), ("epochs", -1), ("gradient_accumulation_steps", 0)],
)
def test_zero_or_negative_counts_are_refused(tmp_path, data, flag, value):
    assert_user_error(cli(tmp_path, data, **{flag: value}), f"--{flag} must be >= 1, got {value}")


@pytest.mark.slow
def test_batch_larger_than_the_training_set_is_refused(tmp_path, data):
    assert_user_error(
        cli(tmp_path, data, batch_size=64),
        "--batch_size 64: the training set has 24 images, fewer than batch_size=64: with drop_last=True "
        "there would be no batch; lower the batch size",
    )


@pytest.mark.slow
def test_missing_data_path_is_refused(tmp_path, data):
    missing = tmp_path / "nowhere"
    assert_user_error(
        cli(tmp_path, missing),
        f"--path_to_data: data folder {missing} does not exist: pass the folder "
        "that holds train/ and val/ or parquet shards (for example --path_to_data "
        "/data/imagenet), or a Hugging Face Hub id such as ILSVRC/imagenet-1k",
    )


@pytest.mark.slow
def test_empty_data_path_is_refused(tmp_path, data):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(
        cli(tmp_path, empty),
        f"--path_to_data: no train/ folder in {empty} (it holds: nothing); expected "
        f"{empty}/train/<class>/*.JPEG and {empty}/val/<class>/*.JPEG",
    )


@pytest.mark.slow
def test_empty_class_folder_is_refused(tmp_path, data):
    root = copy_data(data, tmp_path)
    for f in (root / "train" / "class_01").iterdir():
        f.unlink()
    extensions = "/".join(IMG_EXTENSIONS)  # the data module's list of image extensions
    assert_user_error(
        cli(tmp_path, root),
        f"class folder {root}/train/class_01 has no images ({extensions}): add its images or delete the empty folder",
    )


@pytest.mark.slow
def test_train_val_class_mismatch_is_refused(tmp_path, data):
    root = copy_data(data, tmp_path)
    (root / "val" / "class_02").rename(root / "val" / "class_99")
    assert_user_error(
        cli(tmp_path, root),
        f"{root}/train has 3 classes and {root}/val has 3; only in train: "
        "['class_02'], only in val: ['class_99']: give both splits the same class folders (labels are "
        "positions in the sorted list)",
    )


@pytest.mark.slow
def test_num_classes_contradicting_the_data_is_refused(tmp_path, data):
    assert_user_error(
        cli(tmp_path, data, num_classes=5),
        f"--num_classes 5 but {data} has 3 class folders; drop --num_classes to infer it",
    )


@pytest.mark.slow
def test_unknown_model_is_refused(tmp_path, data):
    n = len(torchvision.models.list_models(module=torchvision.models))
    assert_user_error(
        cli(tmp_path, data, model="resnet51"),
        "--model 'resnet51' is not a torchvision classification model; use 'tinycnn' or one of e.g. "
        f"resnet18, resnet50, mobilenet_v3_small ({n} available)",
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, reason",
    [
        ("zero_byte", "not a recognised image format"),
        ("truncated", "Image is incomplete or truncated"),
        ("random_bytes", "not a recognised image format"),
        ("not_an_image", "not a recognised image format"),
    ],
)
def test_unreadable_image_stops_with_its_name(tmp_path, data, kind, reason):
    root = copy_data(data, tmp_path)
    bad = corrupt_image(root / "train" / "class_00" / "0003.jpg", kind)
    assert_user_error(
        cli(tmp_path, root),
        f"cannot decode image {bad}: {reason}; delete or replace the file, or pass --on_bad_file skip",
    )


@pytest.mark.slow
def test_unreadable_image_is_skipped_and_counted_with_on_bad_file_skip(tmp_path, data):
    root = copy_data(data, tmp_path)
    corrupt_image(root / "train" / "class_00" / "0003.jpg", "zero_byte")
    done = cli(tmp_path, root, on_bad_file="skip")
    assert done.returncode == 0, done.stderr
    assert "skipped" in done.stderr and "0003.jpg" in done.stderr


@pytest.mark.slow
def test_resume_from_a_checkpoint_that_does_not_exist_is_refused(tmp_path, data):
    missing = tmp_path / "runs" / "bad" / "checkpoints" / "step_000000999"
    assert_user_error(
        cli(tmp_path, data, resume_from_checkpoint=missing),
        f"--resume_from_checkpoint {missing} does not exist; pass a folder like "
        f"{tmp_path}/runs/bad/checkpoints/step_000000100, or 'latest'",
    )


@pytest.mark.slow
def test_resume_from_a_half_written_checkpoint_folder_is_refused(tmp_path, data, finished_run):
    half = tmp_path / ".tmp-step_000000004"
    shutil.copytree(latest_checkpoint(finished_run), half)
    (half / MANIFEST).unlink()
    assert_user_error(
        cli(tmp_path, data, resume_from_checkpoint=half),
        f"--resume_from_checkpoint {half} is not a complete checkpoint of this script (no checkpoint.json); "
        f"pass a folder like {tmp_path}/runs/bad/checkpoints/step_000000100, or 'latest'",
    )


@pytest.mark.slow
def test_resume_from_another_models_checkpoint_is_refused(tmp_path, data, finished_run):
    ckpt = latest_checkpoint(finished_run)
    sig = json.loads((ckpt / MANIFEST).read_text())["model_signature"]
    done = cli(tmp_path, data, model="resnet18", resume_from_checkpoint=ckpt)
    from tutorial_lib.checkpoints import model_signature
    from tutorial_lib.flags import build_model

    other = model_signature(build_model("resnet18", 3))
    assert_user_error(
        done,
        f"--resume_from_checkpoint {ckpt} belongs to another model (tinycnn, 3 classes, "
        f"signature {sig}; this run: resnet18, 3 classes, signature {other}); resume with the same "
        "--model and data, or start a new --experiment_name",
    )


@pytest.mark.slow
def test_unwritable_working_directory_is_refused(tmp_path, data):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert_user_error(
        cli(tmp_path, data, working_directory=blocker),
        f"--working_directory {blocker} is not writable (Not a directory); choose a folder you can write to",
    )


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_working_directory_is_refused(tmp_path, data):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert_user_error(
            cli(tmp_path, data, working_directory=locked),
            f"--working_directory {locked} is not writable (Permission denied); choose a folder you can write to",
        )
    finally:
        locked.chmod(0o755)


@pytest.mark.slow
def test_python_m_entry_point_reports_user_errors_the_same_way(tmp_path, data):
    """The fast (forked) runs above call the same `main` as `python -m tutorial_lib.train`."""
    for options, message in [
        ({"num_classes": 5}, f"--num_classes 5 but {data} has 3 class folders; drop --num_classes to infer it")
    ]:
        real = cli(tmp_path, data, launcher="python", **options)
        assert_user_error(real, message)
        forked = cli(tmp_path, data, **options)
        assert (forked.returncode, forked.stderr_lines) == (real.returncode, real.stderr_lines)


# --- safe loading: a planted pickle payload is refused and never runs -----------------------------


class Payload:
    """Unpickling this calls `open(marker, "w")`: the marker file proves the code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def planted_run(tmp_path, finished_run, file_name: str, update_manifest: bool = True) -> tuple[Path, Path]:
    """A copy of `finished_run` (as run "bad") whose latest checkpoint file `file_name` carries a payload.

    With `update_manifest` the attacker also rewrote checkpoint.json, so only the loader can stop it."""
    run = Path(shutil.copytree(finished_run, tmp_path / "runs" / "bad"))
    ckpt, marker = latest_checkpoint(run), tmp_path / "PAYLOAD_RAN"
    torch.save({"state": {}, "param_groups": [], "payload": Payload(marker)}, ckpt / file_name)
    if update_manifest:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        manifest["files"][file_name] = {
            "bytes": (ckpt / file_name).stat().st_size,
            "sha256": sha256_file(ckpt / file_name),
        }
        (ckpt / MANIFEST).write_text(json.dumps(manifest))
    return ckpt, marker


@pytest.mark.slow
@pytest.mark.parametrize("file_name", ["optimizer.bin", "random_states_0.pkl", "scheduler.bin"])
def test_planted_pickle_payload_is_refused_and_never_runs(tmp_path, data, finished_run, file_name):
    ckpt, marker = planted_run(tmp_path, finished_run, file_name)
    done = cli(tmp_path, data, resume_from_checkpoint="latest")
    assert_user_error(
        done,
        f"--resume_from_checkpoint {ckpt}: {file_name} holds more than tensors and numbers (it "
        "refers to io.open); torch.load(weights_only=True) refused it and nothing was run: only "
        "resume from checkpoints you wrote",
    )
    assert not marker.exists(), "the payload ran"
    torch.load(ckpt / file_name, weights_only=False)  # what an unsafe loader would have done
    assert marker.exists(), "the planted payload should be live (else this test proves nothing)"


@pytest.mark.slow
def test_planted_payload_in_the_ema_state_is_refused(tmp_path, data):
    """--ema registers the averaged model with accelerate, which unpickles it with weights_only=False:
    verify_checkpoint must have refused a payload there before accelerate reads it."""
    done = cli(tmp_path, data, ema=True, checkpoint_every_steps=2, experiment_name="ema")
    assert done.returncode == 0, done.stderr
    ckpt, marker = planted_run(tmp_path, tmp_path / "runs" / "ema", "custom_checkpoint_0.pkl")
    assert_user_error(
        cli(tmp_path, data, ema=True, resume_from_checkpoint="latest"),
        f"--resume_from_checkpoint {ckpt}: custom_checkpoint_0.pkl holds more than tensors and numbers "
        "(it refers to io.open); torch.load(weights_only=True) refused it and nothing was run: only "
        "resume from checkpoints you wrote",
    )
    assert not marker.exists(), "the payload ran"


@pytest.mark.slow
def test_extra_pickle_file_in_a_checkpoint_is_refused(tmp_path, data, finished_run):
    """accelerate unpickles `custom_checkpoint_*.pkl` with weights_only=False: such a file must never be loaded."""
    ckpt, marker = planted_run(tmp_path, finished_run, "custom_checkpoint_0.pkl", update_manifest=False)
    assert_user_error(
        cli(tmp_path, data, resume_from_checkpoint="latest"),
        f"--resume_from_checkpoint {ckpt}: unexpected file custom_checkpoint_0.pkl (not written by this "
        "script); refusing to load it",
    )
    assert not marker.exists()


@pytest.mark.slow
def test_altered_checkpoint_file_is_detected_by_its_hash(tmp_path, data, finished_run):
    run = Path(shutil.copytree(finished_run, tmp_path / "runs" / "bad"))
    ckpt = latest_checkpoint(run)
    blob = bytearray((ckpt / "model.safetensors").read_bytes())
    blob[-1] ^= 0xFF  # one flipped bit in the weights
    (ckpt / "model.safetensors").write_bytes(bytes(blob))
    assert_user_error(
        cli(tmp_path, data, resume_from_checkpoint="latest"),
        f"--resume_from_checkpoint {ckpt}: model.safetensors is corrupt (its size or SHA-256 differs from "
        "checkpoint.json); resume from an older checkpoint",
    )


@pytest.mark.slow
def test_no_checkpoint_file_is_unpickled_with_weights_only_false(finished_run):
    """Every file of a checkpoint is safetensors, JSON, or loads with weights_only=True."""
    ckpt = latest_checkpoint(finished_run)
    manifest = verify_checkpoint(ckpt)  # raises if any pickle needs more than weights_only=True allows
    names = sorted(manifest["files"])
    assert names == ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin", "train_state.json"]
    assert not any(name.startswith("custom_checkpoint") for name in os.listdir(ckpt))


# --- atomic checkpoints ----------------------------------------------------------------------------


@pytest.mark.slow
def test_latest_ignores_half_written_checkpoints_with_a_warning(tmp_path, data, finished_run):
    run = Path(shutil.copytree(finished_run, tmp_path / "runs" / "bad"))
    good = latest_checkpoint(run)
    step = int(good.name[5:])
    tmp = run / "checkpoints" / f".tmp-step_{step + 2:09d}"  # a kill during `save_state`
    shutil.copytree(good, tmp)
    (tmp / MANIFEST).unlink()
    (tmp / "optimizer.bin").unlink()
    no_manifest = run / "checkpoints" / f"step_{step + 4:09d}"  # a folder without manifest
    no_manifest.mkdir()
    assert latest_checkpoint(run) == good and incomplete_checkpoints(run) == [tmp, no_manifest]
    done = cli(tmp_path, data, epochs=3, checkpoint_every_steps=2, resume_from_checkpoint="latest")
    assert done.returncode == 0, done.stderr
    assert f"warning: ignoring incomplete checkpoint {tmp} (left by an interrupted save)" in done.stderr_lines
    assert f"warning: ignoring incomplete checkpoint {no_manifest} (left by an interrupted save)" in done.stderr_lines
    assert f"resumed from {good}:" in done.stdout
    assert not tmp.exists(), "the next save should delete the leftover temporary folder"
    assert all((p / MANIFEST).is_file() for p in list_checkpoints(run))


# --- non-finite loss --------------------------------------------------------------------------------

NAN_RUN = dict(epochs=2, checkpoint_every_steps=2, keep_last_checkpoints=10)


@pytest.mark.slow
def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, data):
    clean = cli(tmp_path, data, **NAN_RUN, experiment_name="clean")
    assert clean.returncode == 0, clean.stderr
    run = tmp_path / "runs" / "bad"
    done = cli(tmp_path, data, **NAN_RUN, inject_nan_at_steps=[5])
    assert_user_error(
        done,
        f"the loss became NaN or Inf at optimizer step 5 (epoch 0); training stopped and nothing "
        f"after it was saved. Last good checkpoint: {run}/checkpoints/step_000000004. Lower "
        "--learning_rate or set --max_grad_norm and resume with --resume_from_checkpoint latest, "
        "or pass --on_nonfinite_loss skip to skip such steps",
        code=3,
    )
    assert [p.name for p in list_checkpoints(run)] == ["step_000000002", "step_000000004"]
    good = run / "checkpoints" / "step_000000004"
    verify_checkpoint(good)  # complete and unaltered
    assert sha256_file(good / "model.safetensors") == sha256_file(
        tmp_path / "runs" / "clean" / "checkpoints" / "step_000000004" / "model.safetensors"
    )
    resumed = cli(tmp_path, data, **NAN_RUN, resume_from_checkpoint="latest")
    assert resumed.returncode == 0, resumed.stderr
    assert sha256_file(run / "model.safetensors") == sha256_file(tmp_path / "runs" / "clean" / "model.safetensors")


@pytest.mark.slow
def test_nan_loss_step_is_skipped_and_counted_with_on_nonfinite_loss_skip(tmp_path, data):
    done = cli(tmp_path, data, **NAN_RUN, inject_nan_at_steps=[3, 8], on_nonfinite_loss="skip")
    assert done.returncode == 0, done.stderr
    assert "warning: non-finite loss at optimizer step 3: step skipped (1 so far)" in done.stderr_lines
    assert "warning: non-finite loss at optimizer step 8: step skipped (2 so far)" in done.stderr_lines
    final = json.loads((tmp_path / "runs" / "bad" / "final_metrics.json").read_text())
    assert final["nonfinite_skipped"] == 2 and final["optimizer_steps"] == 12
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(tmp_path / "runs" / "bad" / "model.safetensors").values())


@pytest.mark.slow
def test_skipping_stops_when_every_step_is_non_finite(tmp_path, data):
    done = cli(tmp_path, data, **NAN_RUN, inject_nan_at_steps=list(range(1, 13)), on_nonfinite_loss="skip")
    assert done.returncode == 3 and not done.has_traceback
    assert done.stderr_lines[-1] == (
        "tutorial-train: error: the loss was NaN or Inf at 10 optimizer steps in a row (up to step 10): skipping does "
        "not help, the run diverged; lower --learning_rate or set --max_grad_norm and resume from an earlier checkpoint"
    )


# --- no network ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_wandb_without_credentials_logs_offline_says_so_and_does_not_delay_startup(tmp_path, data):
    home = tmp_path / "home"  # no ~/.netrc, no key in the environment; any network call would go nowhere
    env = child_env(
        HOME=str(home),
        WANDB_MODE=None,
        WANDB_API_KEY=None,
        WANDB_BASE_URL="http://127.0.0.1:9",
        HTTPS_PROXY="http://127.0.0.1:9",
        HTTP_PROXY="http://127.0.0.1:9",
    )
    home.mkdir()
    flags = {**TINY, "path_to_data": data, "working_directory": tmp_path / "runs"}
    # The baseline is a run told to log offline: it pays the same W&B import and service start, which take
    # seconds more on a loaded machine, so the difference is only what finding no key costs (a network wait
    # would be tens of seconds).
    offline = run_cli(
        as_flags({**flags, "experiment_name": "offline", "log_with": "wandb"}),
        env={**env, "WANDB_MODE": "offline"},
        timeout=120,
    )
    online = run_cli(as_flags({**flags, "experiment_name": "wb", "log_with": "wandb"}), env=env, timeout=120)
    assert offline.returncode == 0 and online.returncode == 0, online.stderr[-3000:]
    run = tmp_path / "runs" / "wb"
    assert (
        f"W&B: no API key found (WANDB_API_KEY or `wandb login`), logging offline to {run / 'wandb'}; metrics.jsonl "
        f"has every epoch; upload later with `wandb sync {run / 'wandb'}/offline-run-*`"
    ) in online.stdout
    assert list((run / "wandb").glob("offline-run-*")), "no offline W&B run was written"
    assert online.seconds - offline.seconds < 5, f"finding no key added {online.seconds - offline.seconds:.1f} s"


@pytest.mark.slow
def test_log_with_none_logs_locally_only(tmp_path, data):
    done = cli(tmp_path, data, log_with="none", epochs=2)
    run = tmp_path / "runs" / "bad"
    assert done.returncode == 0, done.stderr
    assert not (run / "wandb").exists() and "W&B" not in done.stdout
    assert [r["epoch"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [0, 1]


# --- one run per folder -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_fresh_run_in_a_folder_holding_a_run_stops_and_changes_nothing(tmp_path, data, finished_run):
    run = Path(shutil.copytree(finished_run, tmp_path / "runs" / "bad"))
    before = {p.relative_to(run): sha256_file(p) for p in run.rglob("*") if p.is_file() and p.name != ".run.lock"}
    assert_user_error(
        cli(tmp_path, data, epochs=2),
        f"{run} already holds a run (checkpoints, metrics.jsonl, model.safetensors, final_metrics.json): "
        "resume it with --resume_from_checkpoint latest, give this run another --experiment_name, or "
        "pass --overwrite to move the old run aside (nothing is deleted)",
    )
    after = {p.relative_to(run): sha256_file(p) for p in run.rglob("*") if p.is_file() and p.name != ".run.lock"}
    assert after == before, "the old run must be left exactly as it was"


@pytest.mark.slow
def test_overwrite_moves_the_old_run_aside_and_never_deletes_it(tmp_path, data, finished_run):
    run = Path(shutil.copytree(finished_run, tmp_path / "runs" / "bad"))
    old_weights = sha256_file(run / "model.safetensors")
    done = cli(tmp_path, data, epochs=1, overwrite=True)
    assert done.returncode == 0, done.stderr
    aside = [p for p in run.parent.iterdir() if p.name.startswith("bad.replaced-")]
    assert len(aside) == 1 and sha256_file(aside[0] / "model.safetensors") == old_weights
    assert [r["epoch"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [0]
    assert_user_error(
        cli(tmp_path, data, overwrite=True, resume_from_checkpoint="latest"),
        "--overwrite moves the run in the folder aside and starts a new one; --resume_from_checkpoint "
        "continues it: give one of them",
    )


@pytest.mark.slow
def test_latest_resumes_only_checkpoints_of_the_folders_own_run(tmp_path, data, finished_run):
    """A checkpoint of another run (a copied folder, say) is never picked by `latest`, even with a higher step."""
    other = cli(tmp_path, data, epochs=3, checkpoint_every_steps=2, experiment_name="other")
    assert other.returncode == 0, other.stderr
    run = Path(shutil.copytree(finished_run, tmp_path / "runs" / "bad"))
    own = latest_checkpoint(run)
    foreign = latest_checkpoint(tmp_path / "runs" / "other")
    shutil.copytree(foreign, run / "checkpoints" / foreign.name)
    assert int(foreign.name[5:]) > int(own.name[5:]) and latest_checkpoint(run).name == foreign.name
    done = cli(tmp_path, data, epochs=3, checkpoint_every_steps=2, resume_from_checkpoint="latest")
    assert done.returncode == 0, done.stderr
    assert f"resumed from {own}:" in done.stdout
    assert any(
        line.startswith(f"warning: ignoring checkpoint {run / 'checkpoints' / foreign.name}: it belongs to run")
        for line in done.stderr_lines
    ), done.stderr


@pytest.mark.slow
def test_a_resume_from_an_older_checkpoint_moves_the_newer_aside_and_latest_then_follows_the_new_branch(
    tmp_path, data, finished_run
):
    """A rollback (after a loss spike, say) continues from an older checkpoint of the run. Killed before it passes the
    step it left, the run must resume its new branch, not the one it left (the highest step): the newer checkpoints
    move aside, nothing is deleted, and `keep_last` prunes the new branch's checkpoints no sooner than usual."""
    run = Path(shutil.copytree(finished_run, tmp_path / "runs" / "bad"))
    older, newer = list_checkpoints(run)  # keep_last 2 of a checkpoint every 2 steps
    left = sha256_file(newer / "model.safetensors")
    branch = cli(tmp_path, data, epochs=2, checkpoint_every_steps=2, resume_from_checkpoint=older, stop_after_steps=11)
    assert branch.returncode == 0, branch.stderr
    assert f"moved the checkpoints newer than {older.name} aside (abandoned-{newer.name}-" in branch.stdout
    aside = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(f"abandoned-{newer.name}-")]
    assert len(aside) == 1 and sha256_file(aside[0] / "model.safetensors") == left, "moved whole, not deleted"
    assert [p.name for p in list_checkpoints(run)] == [older.name, "step_000000011"]
    resumed = cli(tmp_path, data, epochs=2, checkpoint_every_steps=2, resume_from_checkpoint="latest")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {run / 'checkpoints' / 'step_000000011'}:" in resumed.stdout, resumed.stdout
    assert [p.name for p in list_checkpoints(run)] == ["step_000000011", newer.name] and aside[0].is_dir()


# A process that takes a run folder's lock, drops it without `release` (its file stays open: the folder stays locked
# until the process ends), forks a child that outlives it, prints the child's pid and ends.
DROPPED_LOCK = """
import gc, os, sys, time
from tutorial_lib.runs import RunLock
RunLock(sys.argv[1]).acquire()
gc.collect()
child = os.fork()
if child == 0:
    quiet = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(quiet, fd)  # the test's pipes stay with the parent alone
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
"""


@pytest.mark.slow
def test_a_lock_dropped_without_release_is_not_kept_by_a_forked_child_once_its_process_ends(tmp_path):
    """Forked children (data loader workers) close their copies of every lock the process took, also of one it
    dropped without `release`: when the process ends, its folder is free at once, while the child still lives."""
    from tutorial_lib.runs import RunLock

    folder = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", DROPPED_LOCK, str(folder)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    child = int(done.stdout)
    try:
        assert psutil.pid_exists(child), "the forked child ended before the check"
        lock = RunLock(folder)
        lock.acquire()  # RunFolderError if the child still held the file
        lock.release()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_a_second_run_at_once_is_refused_and_a_killed_runs_lock_is_taken_over_while_its_data_worker_lives(
    tmp_path, data
):
    flags = as_flags(
        {
            **TINY,
            "path_to_data": data,
            "working_directory": tmp_path / "runs",
            "experiment_name": "busy",
            "epochs": 200,
            "checkpoint_every_steps": 2,
            "num_workers": 1,  # a data loader worker, forked while the run holds its lock
        }
    )
    first = TrainingProcess(flags, tmp_path / "logs" / "first", launcher="python")  # as `tutorial-train` starts
    run, workers = tmp_path / "runs" / "busy", []
    try:
        lock = run / ".run.lock"
        deadline = time.time() + 120
        while not (lock.exists() and lock.read_text().startswith("pid")) and time.time() < deadline:
            time.sleep(0.1)
        assert first.poll() is None, "the first run should still be running"
        second = run_cli(flags + ["--resume_from_checkpoint", "latest"], timeout=120)
        assert_user_error(
            second,
            f"{run} is in use by another run ({lock.read_text()}): "
            "wait for it to end, or give this run another --experiment_name",
        )
        deadline = time.time() + 120
        while latest_checkpoint(run) is None and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)  # the resume below continues from it (its training loader's worker runs by then)
        assert first.poll() is None and latest_checkpoint(run) is not None, "the run should be running, and have saved"
        workers = psutil.Process(first.pid).children()
        assert workers, "the run should have forked its training loader's worker"
        for worker in workers:  # a worker outlives its killed run by up to seconds: here until the resume is done
            worker.suspend()
        first.kill()  # SIGKILL: its lock file stays behind, its lock does not, even with its worker still alive
        assert lock.exists() and all(worker.is_running() for worker in workers)
        third = run_cli(
            as_flags(
                {
                    **TINY,
                    "path_to_data": data,
                    "working_directory": tmp_path / "runs",
                    "experiment_name": "busy",
                    "epochs": 200,
                    "stop_after_steps": 1,  # reached already: the resume takes the folder, trains nothing, ends
                    "resume_from_checkpoint": "latest",
                }
            ),
            timeout=180,
        )
    finally:
        first.kill()
        for worker in workers:
            with contextlib.suppress(psutil.Error):
                worker.kill()
    assert third.returncode == 0, third.stderr
    assert "--stop_after_steps 1 reached" in third.stdout, third.stdout


# --- resume does what the command line says ---------------------------------------------------------


@pytest.mark.slow
def test_nan_recovery_continues_at_the_lower_learning_rate_given_on_resume(tmp_path, data):
    """The NaN guard's advice, followed: stop at the NaN, resume from the last good checkpoint with a lower LR."""
    options = dict(**NAN_RUN, lr_scheduler="constant", momentum=0.9, weight_decay=1e-4)
    assert cli(tmp_path, data, **options, inject_nan_at_steps=[5]).returncode == 3
    resumed = cli(
        tmp_path,
        data,
        **{**options, "learning_rate": 0.01, "momentum": 0.5, "weight_decay": 0.0},
        resume_from_checkpoint="latest",
    )
    assert resumed.returncode == 0, resumed.stderr
    run = tmp_path / "runs" / "bad"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == [0.01, 0.01], "every epoch after the resume runs at the new learning rate"
    optimizer = torch.load(latest_checkpoint(run) / "optimizer.bin", weights_only=True)
    assert {(g["lr"], g["momentum"], g["weight_decay"]) for g in optimizer["param_groups"]} == {(0.01, 0.5, 0.0)}
    changes = json.loads((run / "config.json").read_text())["changes"]
    assert {"step": 4, "flag": "learning_rate", "from": 0.05, "to": 0.01} in changes, changes
    assert {"step": 4, "flag": "momentum", "from": 0.9, "to": 0.5} in changes, changes


@pytest.mark.slow
@pytest.mark.parametrize("change", [{"batch_size": 8}, {"gradient_accumulation_steps": 2}])
def test_epoch_end_resume_with_another_batch_layout_still_ends_the_schedule(tmp_path, data, change):
    """A cosine schedule keeps its place (epochs done / epochs) under a new layout and ends at --lr_min."""
    options = dict(epochs=3, lr_scheduler="cosine", checkpoint_every_steps=100)
    assert cli(tmp_path, data, **options, stop_after_steps=6).returncode == 0  # 24 images / 4 = 6 steps: 1 epoch
    done = cli(tmp_path, data, **options, **change, resume_from_checkpoint="latest")
    assert done.returncode == 0, done.stderr
    final = json.loads((tmp_path / "runs" / "bad" / "final_metrics.json").read_text())
    assert final["final_lr"] == 0.0, "the schedule must end where it ends"
    steps_per_epoch = 24 // (change.get("batch_size", 4) * change.get("gradient_accumulation_steps", 1))
    assert final["scheduler_steps"] == 3 * steps_per_epoch


@pytest.mark.slow
def test_epoch_end_resume_on_two_processes_still_ends_the_schedule(tmp_path, data):
    options = {
        **TINY,
        "path_to_data": data,
        "working_directory": tmp_path / "runs",
        "experiment_name": "grow",
        "epochs": 3,
        "lr_scheduler": "cosine",
        "batch_size": 4,
    }
    assert run_cli(as_flags({**options, "stop_after_steps": 6})).returncode == 0  # 1 process, epoch 0
    from tutorial_lib.core import free_port

    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        "-m",
        "tutorial_lib.train",
        *as_flags({**options, "resume_from_checkpoint": "latest"}),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    final = json.loads((tmp_path / "runs" / "grow" / "final_metrics.json").read_text())
    assert final["num_processes"] == 2 and final["final_lr"] == 0.0
    assert final["scheduler_steps"] == 3 * 3, "3 steps per epoch per process after the move to 2 processes"


@pytest.mark.slow
def test_a_torn_metrics_file_is_cut_back_on_resume_with_a_warning(tmp_path, data):
    options = dict(epochs=3, checkpoint_every_steps=100)
    assert cli(tmp_path, data, **options, stop_after_steps=12).returncode == 0  # after epoch 1
    metrics = tmp_path / "runs" / "bad" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"epoch": 2, "train_lo')  # a crash in the middle of a line
    done = cli(tmp_path, data, **options, resume_from_checkpoint="latest")
    assert done.returncode == 0, done.stderr
    assert "warning: metrics.jsonl cut back to epoch 2: 0 later and 1 unreadable line(s) dropped" in done.stderr_lines
    assert [json.loads(line)["epoch"] for line in metrics.read_text().splitlines()] == [0, 1, 2]


@pytest.mark.slow
def test_fp16_on_a_cpu_is_refused(tmp_path, data):
    assert_user_error(
        cli(tmp_path, data, mixed_precision="fp16"),
        "--mixed_precision fp16 needs a GPU: on a CPU Accelerate has no fp16 autocast and would silently "
        "train in fp32; use --mixed_precision bf16 or no",
    )


# --- flags that make no sense are refused before any data is read ----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "options, message",
    [
        (
            dict(lr_scheduler="onecycle"),
            "--lr_scheduler onecycle rises during the warmup, but the warmup derived from the "
            "global batch is 0 epochs (5 x (1 - 256 / global batch), none up to 256): give "
            "--lr_warmup_epochs, more than 0 and at most half the run (e.g. --lr_warmup_epochs 0.3)",
        ),
        (
            dict(lr_scheduler="onecycle", lr_warmup_epochs=0),
            "--lr_scheduler onecycle rises during --lr_warmup_epochs: give it "
            "more than 0 and at most half the run (e.g. --lr_warmup_epochs "
            "0.3), not 0",
        ),
        (dict(lr_warmup_epochs=1), "--lr_warmup_epochs 1 covers the whole run of 1 epochs; use fewer warmup epochs"),
        (
            dict(lr_scheduler="multistep"),
            "--lr_scheduler multistep needs --lr_milestones: increasing epochs below --epochs 1 "
            "at which the LR is multiplied by --step_lr_decay, got []",
        ),
        (
            dict(lr_scheduler="cosine", lr_min=0.1),
            "--lr_min 0.1 must be below --learning_rate 0.05: the cosine schedule "
            "decays from the learning rate down to it",
        ),
        (dict(step_lr_decay=1.5), "--step_lr_decay must be in (0, 1], got 1.5"),
        (dict(lr_step_size=0), "--lr_step_size must be a positive number, got 0.0"),
        (
            dict(batch_size=1, model="resnet18"),
            "--batch_size 1 with --model resnet18: BatchNorm normalises over the batch, "
            "so one image per process has no batch statistics; use --batch_size 2 or more",
        ),
    ],
)
def test_impossible_flag_values_are_refused_before_any_data_is_read(tmp_path, options, message, monkeypatch):
    from tutorial_lib import flags
    from tutorial_lib import train as T

    def no_data(args):
        raise AssertionError("the data was read before the flags were checked")

    monkeypatch.setattr(T, "load_data", no_data)
    with pytest.raises(flags.BadFlagError) as refused:
        T.train(
            flags.default_args(
                **{**TINY, "path_to_data": str(tmp_path), "working_directory": str(tmp_path / "runs"), **options}
            )
        )
    assert str(refused.value) == message
    main = cli(tmp_path, tmp_path / "nowhere", **options)  # the command line: one line, exit 2, nothing else
    assert main.returncode == 2 and len(main.stderr_lines) == 1 and not main.has_traceback


@pytest.mark.slow
def test_a_one_class_dataset_and_accumulation_longer_than_an_epoch_are_refused(tmp_path, data):
    one = copy_data(data, tmp_path)
    for split in ("train", "val"):
        for folder in ["class_01", "class_02"]:
            shutil.rmtree(one / split / folder)
    assert_user_error(cli(tmp_path, one), f"--path_to_data {one} has 1 class: a classifier needs two or more")
    assert_user_error(
        cli(tmp_path, data, gradient_accumulation_steps=8, experiment_name="acc"),
        "--gradient_accumulation_steps 8 but an epoch has only 6 batches per process: lower it, or the --batch_size",
    )


# --- signals: finish the step, checkpoint, exit 143 ---------------------------------------------------


# by default the forked run; test_launch_signals stops fresh `python -m` processes (Ctrl-C mid-epoch, a late SIGTERM)
@pytest.mark.slow
@pytest.mark.parametrize("launcher", [pytest.param("python", marks=pytest.mark.full_matrix), "fork"])
def test_sigterm_mid_epoch_checkpoints_and_the_resumed_run_is_bit_identical(tmp_path, data, launcher):
    options = {
        **TINY,
        "path_to_data": data,
        "working_directory": tmp_path / "runs",
        "epochs": 12,
        "checkpoint_every_steps": 100,
        "log_interval": 1,
    }
    straight = run_cli(as_flags({**options, "experiment_name": "straight"}), launcher=launcher)
    assert straight.returncode == 0, straight.stderr
    proc = TrainingProcess(as_flags({**options, "experiment_name": "term"}), tmp_path / "logs" / "term", launcher)
    deadline = time.time() + 120
    metrics = tmp_path / "runs" / "term" / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:  # epoch 0 is done
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    stopped = proc.result(timeout=120)
    assert stopped.returncode == 143 and not stopped.has_traceback, (stopped.returncode, stopped.stderr[-2000:])
    line = [text for text in stopped.stdout.splitlines() if text.startswith("stopped at optimizer step")][-1]
    assert "(SIGTERM): checkpoint saved, resume with --resume_from_checkpoint latest" in line, line
    run = tmp_path / "runs" / "term"
    step = int(line.split()[4].rstrip(","))
    assert latest_checkpoint(run).name == f"step_{step:09d}"
    resumed = run_cli(
        as_flags({**options, "experiment_name": "term", "resume_from_checkpoint": "latest"}), launcher=launcher
    )
    assert resumed.returncode == 0, resumed.stderr
    assert sha256_file(run / "model.safetensors") == sha256_file(tmp_path / "runs" / "straight" / "model.safetensors")


# --- a full disk ---------------------------------------------------------------------------------------


def _can_mount_a_small_disk() -> bool:
    return (
        shutil.which("unshare") is not None
        and subprocess.run(
            ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /mnt"], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_a_small_disk(), reason="needs `unshare -rm` to mount a small tmpfs")
def test_a_full_disk_stops_the_save_with_one_line_and_keeps_the_previous_checkpoint(tmp_path, data):
    """In a private mount namespace, runs write to a 600 KB tmpfs: the third checkpoint (228 KB each) does not fit.
    After the disk is grown (as a user who frees space would), the resumed run ends bit-identical to one that never
    stopped."""
    flags = as_flags(
        {**TINY, "path_to_data": data, "epochs": 3, "checkpoint_every_steps": 2, "keep_last_checkpoints": 10}
    )
    straight = run_cli(flags + ["--working_directory", str(tmp_path / "runs"), "--experiment_name", "straight"])
    assert straight.returncode == 0, straight.stderr
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f"""
mount -t tmpfs -o size=600k tmpfs {disk}
{sys.executable} -m tutorial_lib.train {" ".join(flags)} --working_directory {disk} --experiment_name full \
    > {tmp_path}/full.out 2> {tmp_path}/full.err
echo $? > {tmp_path}/full.code
cp -r {disk}/full {tmp_path}/after_full
mount -o remount,size=50m {disk}
{sys.executable} -m tutorial_lib.train {" ".join(flags)} --working_directory {disk} --experiment_name full \
    --resume_from_checkpoint latest > {tmp_path}/resumed.out 2> {tmp_path}/resumed.err
echo $? > {tmp_path}/resumed.code
cp {disk}/full/model.safetensors {tmp_path}/resumed.safetensors
"""
    subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=child_env(), timeout=300, check=True)
    full = CliResult(
        int((tmp_path / "full.code").read_text()),
        (tmp_path / "full.out").read_text(),
        (tmp_path / "full.err").read_text(),
        0.0,
    )
    assert full.returncode == 2 and not full.has_traceback and len(full.stderr_lines) == 1, full.stderr
    assert full.stderr_lines[0].startswith(
        f"tutorial-train: error: no space left on the disk of {disk / 'full'} while saving the checkpoint of step"
    ), full.stderr
    assert "which is intact)" in full.stderr_lines[0]
    kept = tmp_path / "after_full"
    assert not incomplete_checkpoints(kept), "the half-written checkpoint must be removed"
    verify_checkpoint(latest_checkpoint(kept))  # the previous checkpoint is complete and unaltered
    assert int((tmp_path / "resumed.code").read_text()) == 0, (tmp_path / "resumed.err").read_text()
    assert sha256_file(tmp_path / "resumed.safetensors") == sha256_file(
        tmp_path / "runs" / "straight" / "model.safetensors"
    )


# --- trackers: offline, and one continuous run across a resume ------------------------------------------


def scalar_steps(run_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for folder in sorted({p.parent for p in (run_dir / "tensorboard").rglob("events.out.tfevents.*")}):
        events = EventAccumulator(str(folder))
        events.Reload()
        steps += [e.step for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []
    return steps


@pytest.mark.slow
def test_tensorboard_logs_offline_and_a_resumed_run_continues_its_steps(tmp_path, data):
    options = dict(epochs=3, log_with="tensorboard", checkpoint_every_steps=100)
    assert cli(tmp_path, data, **options, stop_after_steps=9).returncode == 0  # stopped in epoch 1
    done = cli(tmp_path, data, **options, resume_from_checkpoint="latest")
    assert done.returncode == 0, done.stderr
    run = tmp_path / "runs" / "bad"
    assert scalar_steps(run, "epoch/val_top1") == [6, 12, 18], "one point per epoch, steps continuing across the resume"
    assert not (run / "wandb").exists()


@pytest.mark.slow
def test_several_trackers_at_once_and_none_alone(tmp_path, data):
    env = child_env(WANDB_MODE="offline")
    flags = as_flags({**TINY, "path_to_data": data, "working_directory": tmp_path / "runs", "experiment_name": "both"})
    done = run_cli(flags + ["--log_with", "wandb", "tensorboard"], env=env, timeout=180)
    assert done.returncode == 0, done.stderr
    run = tmp_path / "runs" / "both"
    assert list((run / "wandb").glob("offline-run-*")) and scalar_steps(run, "epoch/val_top1") == [6]
    assert_user_error(
        cli(tmp_path, data, log_with=["wandb", "none"]), "--log_with wandb none: 'none' means no tracker; give it alone"
    )


@pytest.mark.slow
def test_skipped_files_are_counted_per_epoch_named_once_and_validation_counts_each_image_once(tmp_path, data):
    root = copy_data(data, tmp_path)
    bad_train = corrupt_image(root / "train" / "class_00" / "0003.jpg", "zero_byte")
    bad_val = corrupt_image(root / "val" / "class_01" / "0001.jpg", "truncated")
    done = cli(tmp_path, root, on_bad_file="skip", epochs=2)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs" / "bad" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["skipped_train"], r["skipped_val"]) for r in rows] == [(1, 1), (1, 1)], "each met once per epoch"
    assert all(r["val_count"] == 5 for r in rows), "6 validation images, one unreadable: 5 counted, none twice"
    final = json.loads((tmp_path / "runs" / "bad" / "final_metrics.json").read_text())
    assert final["skipped_files"] == 4 and sorted(final["bad_files"]) == sorted([str(bad_train), str(bad_val)])
    epoch_lines = [line for line in done.stderr_lines if line.startswith("warning: epoch ")]
    assert len(epoch_lines) == 2 and str(bad_train) in epoch_lines[0] and str(bad_train) not in epoch_lines[1]


@pytest.mark.slow
def test_what_the_scan_leaves_out_is_said_once(tmp_path, data):
    root = copy_data(data, tmp_path)
    (root / "train" / "class_00" / ".ipynb_checkpoints").mkdir()
    shutil.copy(root / "train" / "class_00" / "0000.jpg", root / "train" / "class_00" / ".ipynb_checkpoints" / "x.jpg")
    (root / "train" / "class_00" / "scan.tif").write_bytes(b"II*\x00")
    done = cli(tmp_path, root, val_img_size=24)  # two scans of the data: still one line
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr_lines if "left out" in line]
    assert len(lines) == 1 and "hidden folder" in lines[0] and ".tif" in lines[0], done.stderr
