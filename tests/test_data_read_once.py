"""A run resolves `--path_to_data` once and scans each split folder once (1.28 M files in ImageNet's train/),
also when validation runs at its own size (--val_img_size other than the training crop)."""

from collections import Counter
from pathlib import Path

import pytest
from train_helpers import TINY

from tutorial_lib import sources
from tutorial_lib.flags import default_args
from tutorial_lib.loading import build_datasets
from tutorial_lib.train import train


@pytest.fixture
def counted(monkeypatch) -> Counter:
    """Counts, by folder name, every scan of a split folder and every resolution of a data folder."""
    calls: Counter = Counter()
    scan, find = sources.scan_image_folder, sources.find_split_dirs

    def counting_scan(folder, *args, **kwargs):
        calls[f"scan {Path(folder).name}"] += 1
        return scan(folder, *args, **kwargs)

    def counting_find(root):
        calls["resolve"] += 1
        return find(root)

    monkeypatch.setattr(sources, "scan_image_folder", counting_scan)
    monkeypatch.setattr(sources, "find_split_dirs", counting_find)
    return calls


def test_build_datasets_scans_each_split_once_when_validation_has_its_own_size(counted):
    train_ds, val_ds = build_datasets(sources.embedded_data_path(), img_size=16, val_img_size=24, log=None)
    assert counted == Counter({"resolve": 1, "scan train": 1, "scan val": 1}), counted
    assert train_ds[0][0].shape[-1] == 16 and val_ds[0][0].shape[-1] == 24, "each split at its own size"


@pytest.mark.slow  # trains
def test_a_run_resolves_the_data_once_and_scans_each_split_once(tmp_path, counted):
    args = default_args(
        **{**TINY, "epochs": 1, "val_img_size": 24, "working_directory": str(tmp_path), "experiment_name": "once"}
    )
    train(args)
    assert counted == Counter({"resolve": 1, "scan train": 1, "scan val": 1}), (
        f"--path_to_data resolved and each split scanned once per run, got {dict(counted)}"
    )
