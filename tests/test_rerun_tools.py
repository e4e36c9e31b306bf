"""The data tools and the training command line run again, or signalled, at any moment (issue 41's items 5, 6, 13).

`shard` run again after its source changed rebuilds exactly the shards whose images or labels changed (notebook
07b §2); `prepare-val --out` on another file system moves so that a kill leaves the original or a complete copy
(07b §1); a SIGTERM while a finished or stopped run exits leaves it its own status (06b, 08b)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from train_helpers import CASE_RUN

from tutorial_lib import data as data_tools
from tutorial_lib.cli import as_flags
from tutorial_lib.data import write_shards
from tutorial_lib.launching import EXIT_STATUS_ENV, read_exit_status
from tutorial_lib.processes import child_env, make_image_folder
from tutorial_lib.sources import scan_image_folder

# --- item 5: shard run again after its source changed --------------------------------------------------------

SHARD_MB = 0.004  # 4 kB: about six 16-px JPEGs per shard, so one change touches a few shards of many


def shard_rows(out: Path, split: str) -> list[tuple[str, int, bytes]]:
    """(path under the split folder, label, stored bytes) of every row of `split`'s shards, in order."""
    tables = [pq.read_table(p).to_pylist() for p in sorted((out / "data").glob(f"{split}-*.parquet"))]
    return [(r["image"]["path"], r["label"], r["image"]["bytes"]) for rows in tables for r in rows]


def source_rows(split_dir: Path) -> list[tuple[str, int, bytes]]:
    _, samples = scan_image_folder(split_dir)
    return [(os.path.relpath(p, split_dir), y, Path(p).read_bytes()) for p, y in samples]


def test_shard_run_again_after_its_source_changed_holds_exactly_the_source_and_keeps_the_rest(tmp_path, monkeypatch):
    """A damaged image replaced and an image moved to its right class: the rerun rebuilds the shards whose images or
    labels changed and says so, keeps the others, and the shards hold the source as it is now (before: the shards
    with the old row counts were kept, an image went missing, another appeared twice, 'written' said nothing).
    A rerun over an unchanged source reads no image."""
    src = make_image_folder(tmp_path / "src", classes=4, train_per_class=8, val_per_class=2)
    out = tmp_path / "shards"
    first = write_shards(src, out, shard_mb=SHARD_MB, log=lambda line: None)
    assert first["shards"] >= 6, first
    written = {p.name: p.stat().st_mtime_ns for p in (out / "data").glob("*.parquet")}
    train = src / "train"
    (train / "class_03" / "0007.jpg").write_bytes((train / "class_03" / "0006.jpg").read_bytes())  # replaced
    (train / "class_00" / "0003.jpg").rename(train / "class_01" / "0003_moved.jpg")  # to its right class
    lines = []
    again = write_shards(src, out, shard_mb=SHARD_MB, log=lines.append)
    for split, folder in (("train", train), ("validation", src / "val")):
        assert shard_rows(out, split) == source_rows(folder), f"the {split} shards do not hold the source as it is now"
    assert again["shards"] == first["shards"] and 1 <= again["rebuilt"] == again["written"] < again["shards"], again
    assert f"{again['rebuilt']} out of date (their images or labels changed since: rebuilt)" in lines[-1], lines
    kept = [p for p in (out / "data").glob("*.parquet") if p.stat().st_mtime_ns == written[p.name]]
    assert len(kept) == again["shards"] - again["written"] and any(p.name.startswith("validation") for p in kept)

    def no_reading(*args, **kwargs):
        raise AssertionError("an unchanged source was read again")

    monkeypatch.setattr(data_tools, "shard_table", no_reading)
    assert write_shards(src, out, shard_mb=SHARD_MB, log=lambda line: None)["written"] == 0


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
