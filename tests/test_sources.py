"""ImageNet in the forms people have it (07 §1, §9–§13): parquet shards shaped like the Hub's
`ILSVRC/imagenet-1k`, `save_to_disk` folders, Hub ids, the official ILSVRC2012 archives, and the
`shard` / `from-archives` commands.

Everything runs offline: the Hub is never contacted (HF_HUB_OFFLINE), the parquet shards and the
archives are built here from the embedded images, and the `datasets` cache goes to a temporary folder."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports datasets (also inherited by subprocesses)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import hashlib
import io
import json
import random
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader
from train_helpers import ROOT, TINY, bitwise_equal, exit_status, launch, max_weight_difference, weights

import tutorial_lib.data as data_module
from tutorial_lib.checkpoints import latest_checkpoint
from tutorial_lib.data import from_archives, main, read_devkit, verify_unpacked, write_shards
from tutorial_lib.databench import format_data_benchmark, run_data_benchmark
from tutorial_lib.flags import default_args
from tutorial_lib.loading import build_datasets
from tutorial_lib.processes import make_image_folder
from tutorial_lib.sources import (
    DataLayoutError,
    DataSourceError,
    RecordReader,
    UnreadableImageError,
    embedded_data_path,
    resolve_data_source,
    scan_image_folder,
)
from tutorial_lib.train import train

EMBEDDED = embedded_data_path()
# The Arrow schema of ILSVRC/imagenet-1k's parquet files, written out by hand (not taken from our code)
HUB_SCHEMA = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("label", pa.int64())])


@pytest.fixture(autouse=True)
def offline_and_private_cache(tmp_path_factory, monkeypatch):
    """No Hub call can happen, and the Arrow copies of parquet go to a temporary folder, not ~/.cache."""
    import datasets

    cache = tmp_path_factory.getbasetemp() / "hf_datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))


def hub_features_json(classes: list[str]) -> bytes:
    return json.dumps(
        {"info": {"features": {"image": {"_type": "Image"}, "label": {"names": classes, "_type": "ClassLabel"}}}}
    ).encode()


def write_hub_parquet(out: Path, src: Path = EMBEDDED, shards: int = 3, test_split: bool = False) -> Path:
    """Folders of `src` as `out/data/{split}-KKKKK-of-NNNNN.parquet` with the exact schema of ILSVRC/imagenet-1k.

    Written with pyarrow directly, independently of `write_shards`; rows in the order of the folders."""
    (out / "data").mkdir(parents=True, exist_ok=True)
    splits = [("train", "train"), ("validation", "val")] + [("test", "val")] * test_split
    for split, folder in splits:
        classes = sorted(d.name for d in (src / folder).iterdir() if d.is_dir())
        files = [(p, y) for y, c in enumerate(classes) for p in sorted((src / folder / c).iterdir())]
        schema = HUB_SCHEMA.with_metadata({"huggingface": hub_features_json(classes)})
        for k in range(shards):
            part = files[k * len(files) // shards : (k + 1) * len(files) // shards]
            labels = [-1 if split == "test" else y for _, y in part]  # the Hub's test split has no labels
            table = pa.table(
                {"image": [{"bytes": p.read_bytes(), "path": p.name} for p, _ in part], "label": labels}, schema=schema
            )
            pq.write_table(table, out / "data" / f"{split}-{k:05d}-of-{shards:05d}.parquet")
    return out


@pytest.fixture(scope="module")
def hub_parquet(tmp_path_factory):
    return write_hub_parquet(tmp_path_factory.mktemp("hub") / "imagenet-1k")


def tiny_tree(root: Path, classes=("n01", "n02"), per_class: int = 3) -> Path:
    """train/ and val/ with a few embedded JPEGs per class."""
    pictures = sorted((EMBEDDED / "train" / "cat").iterdir())
    k = 0
    for split in ("train", "val"):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for j in range(per_class):
                (root / split / c / f"{c}_{j}.JPEG").write_bytes(pictures[k].read_bytes())
                k += 1
    return root


# --- resolve_data_source: which form is it? ------------------------------------------------------------------


def test_resolve_data_source_tells_each_form_apart(tmp_path, hub_parquet):
    assert resolve_data_source(EMBEDDED).kind == "folders"
    source = resolve_data_source(hub_parquet)
    assert source.kind == "parquet" and [Path(f).name for f in source.files["validation"]] == [
        f"validation-{k:05d}-of-00003.parquet" for k in range(3)
    ]
    split_folders = tmp_path / "split_folders"
    for split in ("train", "validation"):
        (split_folders / split).mkdir(parents=True)
        (split_folders / split / "0000.parquet").write_bytes(
            (hub_parquet / "data" / f"{split}-00000-of-00003.parquet").read_bytes()
        )
    assert resolve_data_source(split_folders).kind == "parquet"
    hub = resolve_data_source("ILSVRC/imagenet-1k")
    assert (hub.kind, hub.location) == ("hub", "ILSVRC/imagenet-1k")
    assert resolve_data_source(source) is source


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("missing", FileNotFoundError, ["does not exist", "Hub id"]),
        ("file", NotADirectoryError, ["is a file"]),
        ("archives", DataSourceError, ["from-archives"]),
        ("no validation shards", DataSourceError, ["validation"]),
        ("unknown split", DataSourceError, ["cannot tell the split", "train-*.parquet"]),
        ("one saved split", DataSourceError, ["one split"]),
        ("saved without validation", DataSourceError, ["'train'", "'validation'"]),
        ("no train folder", FileNotFoundError, ["no train/"]),
    ],
)
def test_unusable_sources_are_refused_with_one_line_saying_what_to_change(tmp_path, case, error, words):
    root = tmp_path / "data"
    root.mkdir()
    if case == "missing":
        root = tmp_path / "not" / "here"
    elif case == "file":
        root = tmp_path / "train.parquet"
        root.write_bytes(b"")
    elif case == "archives":
        (root / "ILSVRC2012_img_val.tar").write_bytes(b"")
    elif case == "no validation shards":
        (root / "train-00000-of-00001.parquet").write_bytes(b"")
    elif case == "unknown split":
        (root / "train-00000-of-00001.parquet").write_bytes(b"")
        (root / "part-0.parquet").write_bytes(b"")
    elif case == "one saved split":
        (root / "state.json").write_text("{}")
    elif case == "saved without validation":
        (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    elif case == "no train folder":
        (root / "notes.txt").write_text("")
    with pytest.raises(error) as caught:
        resolve_data_source(root)
    message = str(caught.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_missing_datasets_package_says_how_to_install_it(monkeypatch, hub_parquet):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    for where in [hub_parquet, "ILSVRC/imagenet-1k"]:
        with pytest.raises(DataSourceError, match=r'pip install -e "\.\[hub\]"'):
            resolve_data_source(where)
    assert resolve_data_source(EMBEDDED).kind == "folders", "folders never need the optional package"


# --- parquet shards ------------------------------------------------------------------------------------------


def test_parquet_samples_match_the_folders_sample_by_sample(hub_parquet):
    pq_train, pq_val = build_datasets(hub_parquet, img_size=32)
    dir_train, dir_val = build_datasets(EMBEDDED, img_size=32)
    assert isinstance(pq_train.reader, RecordReader) and pq_train.classes == dir_train.classes == pq_val.classes
    assert (len(pq_train), len(pq_val)) == (len(dir_train), len(dir_val)) == (4000, 1000)
    assert np.array_equal(pq_train.targets, dir_train.targets) and np.array_equal(pq_val.targets, dir_val.targets)
    for ds_pq, ds_dir in [(pq_train, dir_train), (pq_val, dir_val)]:
        for i in range(0, len(ds_dir), 131):
            random.seed(i)  # the random state the training script sets for each sample (08b)
            x_pq, y_pq = ds_pq[i]
            random.seed(i)
            x_dir, y_dir = ds_dir[i]
            assert torch.equal(x_pq, x_dir) and y_pq == y_dir, i


def test_parquet_classic_and_gpu_pipelines_read_the_same_bytes(hub_parquet):
    pq_train, _ = build_datasets(hub_parquet, img_size=32, pipeline="gpu")
    dir_train, _ = build_datasets(EMBEDDED, img_size=32, pipeline="gpu")
    assert all(torch.equal(pq_train[i][0], dir_train[i][0]) for i in (0, 1234, 3999)), "encoded bytes unchanged"
    c_pq, _ = build_datasets(hub_parquet, img_size=32, pipeline="classic")
    c_dir, _ = build_datasets(EMBEDDED, img_size=32, pipeline="classic")
    torch.manual_seed(0)
    a = c_pq[7][0]
    torch.manual_seed(0)
    assert torch.equal(a, c_dir[7][0]) and a.dtype == torch.float32


TRAIN = dict(
    model="tinycnn",
    img_size=32,
    epochs=2,
    batch_size=16,
    max_train_samples=64,
    max_val_samples=32,
    learning_rate=0.05,
    momentum=0.9,
    lr_scheduler="step",
    lr_step_size=1,
    step_lr_decay=0.5,
    num_workers=0,
    cpu=True,
    log_with="none",
    disable_progress_bar=True,
)  # 4 steps per epoch


def run(tmp_path, name, data, **overrides) -> dict:
    return train(
        default_args(
            **{
                **TRAIN,
                "path_to_data": str(data),
                "working_directory": str(tmp_path),
                "experiment_name": name,
                **overrides,
            }
        )
    )


@pytest.mark.slow
def test_training_from_hub_parquet_is_bit_identical_to_training_from_folders(tmp_path, hub_parquet):
    """Same order, same augmentation, same weights; a mid-epoch stop and resume on parquet, with 2 loader
    workers after the resume, also ends on the same weights."""
    folders = run(tmp_path, "folders", EMBEDDED)
    parquet = run(tmp_path, "parquet", hub_parquet)
    assert folders["optimizer_steps"] == parquet["optimizer_steps"] == 8
    assert bitwise_equal(weights(tmp_path / "folders"), weights(tmp_path / "parquet")), (
        f"weights differ by {max_weight_difference(weights(tmp_path / 'folders'), weights(tmp_path / 'parquet'))}"
    )
    stopped = run(tmp_path, "resumed", hub_parquet, stop_after_steps=6)  # mid-epoch 1
    assert stopped["stopped"] and latest_checkpoint(tmp_path / "resumed").name == "step_000000006"
    run(tmp_path, "resumed", hub_parquet, resume_from_checkpoint="latest", num_workers=2)
    assert bitwise_equal(weights(tmp_path / "folders"), weights(tmp_path / "resumed"))


@pytest.mark.slow
def test_two_processes_shard_parquet_records_like_folders(tmp_path, hub_parquet, monkeypatch):
    """2 gloo processes × batch 8 on parquet (both converting the shards into one empty cache at once)
    against 1 process × batch 16 on folders, the set-up of test_train_distributed: every sample seen
    once, the same weights within the float error DDP's summation order allows there."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    common = {**TINY, "working_directory": str(tmp_path), "gradient_accumulation_steps": 3}
    launch({**common, "path_to_data": str(hub_parquet), "batch_size": 8, "experiment_name": "ddp"})
    single = train(default_args(**{**common, "batch_size": 16, "experiment_name": "single"}))
    ddp = json.loads((tmp_path / "ddp" / "final_metrics.json").read_text())
    assert ddp["num_processes"] == 2 and ddp["val_count"] == single["val_count"] == TINY["max_val_samples"]
    diff = max_weight_difference(weights(tmp_path / "ddp"), weights(tmp_path / "single"))
    assert diff <= 1e-6, diff  # test_train_distributed's bound for the same runs from folders


@pytest.mark.slow
def test_corrupt_record_is_named_by_shard_and_row_and_skipped_on_request(tmp_path):
    src = tiny_tree(tmp_path / "src", per_class=4)
    victim = src / "train" / "n02" / "n02_1.JPEG"  # sample 5 of 8: row 1 of the second shard of two
    victim.write_bytes(victim.read_bytes()[:200])
    out = write_hub_parquet(tmp_path / "pq", src, shards=2)
    strict, _ = build_datasets(out, img_size=16)
    with pytest.raises(UnreadableImageError) as caught:
        strict[5]
    message = str(caught.value)
    assert f"n02_1.JPEG at row 1 of {out / 'data' / 'train-00001-of-00002.parquet'} (row 5 of" in message, message
    assert "on_bad_file='skip'" in message and "\n" not in message
    skip, _ = build_datasets(out, img_size=16, on_bad_file="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches = list(DataLoader(skip, batch_size=2, num_workers=2))
    assert sum(len(y) for _, y in batches) == 8 and skip.skipped == 1, "met once in a worker, counted once"
    assert "skipped 1 unreadable" in skip.skip_report()


@pytest.mark.slow
def test_training_script_stops_on_a_corrupt_record_naming_it(tmp_path, capsys):
    from tutorial_lib.train import main as train_main

    src = tiny_tree(tmp_path / "src", per_class=8)
    (src / "train" / "n01" / "n01_3.JPEG").write_bytes(b"not a jpeg")
    out = write_hub_parquet(tmp_path / "pq", src, shards=2)
    argv = [
        "--model",
        "tinycnn",
        "--img_size",
        "16",
        "--epochs",
        "1",
        "--batch_size",
        "4",
        "--num_workers",
        "0",
        "--cpu",
        "--log_with",
        "none",
        "--disable_progress_bar",
        "--path_to_data",
        str(out),
        "--working_directory",
        str(tmp_path),
        "--experiment_name",
        "bad",
    ]
    with pytest.raises(SystemExit) as caught:
        train_main(argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert caught.value.code == 2 and last.startswith("tutorial-train: error: cannot decode image"), last
    assert f"n01_3.JPEG at row 3 of {out / 'data' / 'train-00000-of-00002.parquet'}" in last, last
    assert "--on_bad_file skip" in last


def test_save_to_disk_folder_reads_like_the_shards(tmp_path, hub_parquet):
    from datasets import DatasetDict

    pq_train, pq_val = build_datasets(hub_parquet, img_size=32)
    DatasetDict({"train": pq_train.reader.records, "validation": pq_val.reader.records}).save_to_disk(
        tmp_path / "saved"
    )
    assert resolve_data_source(tmp_path / "saved").kind == "saved"
    saved_train, saved_val = build_datasets(tmp_path / "saved", img_size=32, pipeline="gpu")
    dir_train, _ = build_datasets(EMBEDDED, img_size=32, pipeline="gpu")
    assert saved_train.classes == dir_train.classes and len(saved_val) == 1000
    assert all(torch.equal(saved_train[i][0], dir_train[i][0]) for i in (0, 2500, 3999))
    assert ".arrow" in saved_train.reader.describe(10), "a saved record is named by its Arrow file"


def test_hub_id_is_loaded_with_its_train_and_validation_splits(tmp_path, monkeypatch):
    """The Hub replaced by a local folder of the same layout (the download is all that differs); its
    unlabelled test split is ignored."""
    import datasets

    local = write_hub_parquet(tmp_path / "hub_copy", tiny_tree(tmp_path / "src"), shards=1, test_split=True)
    real = datasets.load_dataset
    monkeypatch.setattr(
        datasets, "load_dataset", lambda path, **kw: real(str(local) if path == "someone/imagenet-1k" else path, **kw)
    )
    train_ds, val_ds = build_datasets("someone/imagenet-1k", img_size=16)
    assert train_ds.classes == ["n01", "n02"] and (len(train_ds), len(val_ds)) == (6, 6)
    assert train_ds.root == "someone/imagenet-1k [train]" and val_ds[5][1] == 1


def test_unreachable_hub_id_fails_with_one_line(tmp_path):
    with pytest.raises(DataSourceError) as caught:
        build_datasets("nobody-here/no-such-dataset", img_size=16)
    message = str(caught.value)
    assert "nobody-here/no-such-dataset" in message and "hf auth login" in message and "\n" not in message


@pytest.mark.slow
def test_training_script_trains_from_a_hub_id_as_from_folders(tmp_path, monkeypatch, hub_parquet):
    """The Hub replaced by a local folder of the same layout: the same weights as from the folders."""
    import datasets

    real = datasets.load_dataset
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda path, **kw: real(str(hub_parquet) if path == "ILSVRC/imagenet-1k" else path, **kw),
    )
    run(tmp_path, "hub", "ILSVRC/imagenet-1k")
    run(tmp_path, "folders", EMBEDDED)
    assert bitwise_equal(weights(tmp_path / "hub"), weights(tmp_path / "folders"))


# --- shard: folders → parquet shards -------------------------------------------------------------------------


def test_shard_writes_the_hub_schema_with_the_folders_bytes_in_order(tmp_path):
    counts = write_shards(EMBEDDED, tmp_path / "shards", shard_mb=1, log=lambda s: None)
    files = sorted((tmp_path / "shards" / "data").glob("*.parquet"))
    assert counts == {
        "train": 4000,
        "validation": 1000,
        "classes": 10,
        "shards": len(files),
        "written": len(files),
        "out": str(tmp_path / "shards" / "data"),
    }
    assert [f.name for f in files if f.name.startswith("train")] == [
        f"train-{k:05d}-of-00004.parquet" for k in range(4)
    ]
    classes, samples = scan_image_folder(EMBEDDED / "train")
    for f in files:
        schema = pq.read_schema(f)
        assert schema.remove_metadata().equals(HUB_SCHEMA) and schema.metadata[b"huggingface"] == hub_features_json(
            classes
        )
    rows = pa.concat_tables(pq.read_table(f) for f in files if f.name.startswith("train")).to_pylist()
    assert [(r["image"]["bytes"], r["label"]) for r in rows] == [(Path(p).read_bytes(), y) for p, y in samples]
    assert rows[0]["image"]["path"] == "airplane/0000.jpg"
    sizes = [f.stat().st_size for f in files if f.name.startswith("train")]
    assert all(s >= 1e6 for s in sizes[:-1]) and max(sizes) < 1.2e6, sizes  # each closes once it holds 1 MB


def test_shard_resumes_and_refuses_another_runs_shards(tmp_path):
    src = tiny_tree(tmp_path / "src", per_class=6)
    out = tmp_path / "shards"
    write_shards(src, out, shard_mb=0.005, log=lambda s: None)  # 5 kB: a few images per shard
    files = sorted((out / "data").glob("*.parquet"))
    before = {f.name: f.stat().st_mtime_ns for f in files}
    files[1].unlink()  # as if the run had stopped while writing it
    (out / "data" / f".tmp-{files[1].name}").write_bytes(b"half")
    again = write_shards(src, out, shard_mb=0.005, log=lambda s: None)
    assert again["written"] == 1 and not list((out / "data").glob(".tmp-*"))
    assert all(f.stat().st_mtime_ns == before[f.name] for f in files if f != files[1]), "complete shards are kept"
    train_ds, _ = build_datasets(out, img_size=16)
    assert len(train_ds) == 12
    with pytest.raises(DataLayoutError, match="another run"):
        write_shards(src, out, shard_mb=1, log=lambda s: None)


PHOTOS = ROOT / "tests" / "assets" / "imagenet"  # 333-500 px real photos: one RGB, one grayscale, one CMYK …


def photo_tree(root: Path) -> Path:
    """The committed photos as train/ and val/, one class per photo (named by its wnid)."""
    for split in ["train", "val"]:
        for photo in sorted(PHOTOS.glob("*.JPEG")):
            (root / split / photo.name[:9]).mkdir(parents=True, exist_ok=True)
            (root / split / photo.name[:9] / photo.name).write_bytes(photo.read_bytes())
    return root


def shard_rows(out: Path) -> dict[str, bytes]:
    """Path under the split folder -> stored bytes, over every shard of `out`."""
    tables = [pq.read_table(p) for p in sorted((out / "data").glob("*.parquet"))]
    return {row["image"]["path"]: row["image"]["bytes"] for t in tables for row in t.to_pylist()}


def test_presized_shards_keep_small_images_bytes_and_shrink_the_others_as_their_footers_say(tmp_path):
    from PIL import Image

    src, out = photo_tree(tmp_path / "photos"), tmp_path / "shards"
    done = write_shards(src, out, max_side=400, jpeg_quality=85, log=lambda s: None)
    rows = shard_rows(out)
    assert len(rows) == 5  # train and val hold the same relative paths
    for path, stored in rows.items():
        original = (src / "train" / path).read_bytes()
        (w0, h0), (w1, h1) = Image.open(io.BytesIO(original)).size, Image.open(io.BytesIO(stored)).size
        if max(w0, h0) <= 400:
            assert stored == original, path  # the 400 x 300 photo: byte for byte
        else:
            assert (w1, h1) == (round(w0 * 400 / max(w0, h0)), round(h0 * 400 / max(w0, h0))), (path, w1, h1)
            assert Image.open(io.BytesIO(stored)).format == "JPEG" and stored != original
    assert done["presized"] == {"max_side": 400, "jpeg_quality": 85, "resized": 8, "kept": 2, "unreadable": 0}
    for shard in (out / "data").glob("*.parquet"):
        footer = pq.read_metadata(shard).metadata
        assert json.loads(footer[b"tutorial_lib.presize"]) == {"max_side": 400, "jpeg_quality": 85}
        assert json.loads(footer[b"tutorial_lib.presized"]) == {"resized": 4, "kept": 1, "unreadable": 0}
    assert write_shards(src, out, max_side=400, jpeg_quality=85, log=lambda s: None)["written"] == 0
    rewritten = write_shards(src, out, max_side=300, jpeg_quality=85, log=lambda s: None)  # other settings
    assert rewritten["written"] == 2 and rewritten["presized"]["resized"] == 10, "a shard never mixes two settings"
    plain = write_shards(src, out, log=lambda s: None)
    assert plain["written"] == 2 and shard_rows(out) == {p: (src / "train" / p).read_bytes() for p in rows}


def test_the_free_space_check_of_presized_shards_counts_them_by_the_images_sizes(tmp_path, monkeypatch):
    src = photo_tree(tmp_path / "photos")
    source_bytes = sum(f.stat().st_size for f in src.rglob("*.JPEG"))  # 10 photos, longer sides 400 to 500 px
    free = {"bytes": source_bytes // 2}
    monkeypatch.setattr(data_module.shutil, "disk_usage", lambda path: type("Usage", (), {"free": free["bytes"]})())
    with pytest.raises(DataSourceError, match="needs .* free"):
        write_shards(src, tmp_path / "plain", log=lambda s: None)  # as they are, the photos do not fit
    done = write_shards(src, tmp_path / "small", max_side=200, log=lambda s: None)  # about a fifth of the pixels
    written = sum(f.stat().st_size for f in (tmp_path / "small" / "data").glob("*.parquet"))
    assert done["written"] == 2 and done["presized"]["resized"] == 10 and written < free["bytes"]
    free["bytes"] = source_bytes // 20
    with pytest.raises(DataSourceError, match=r"for the shards \(pre-sized, estimated\): it needs about"):
        write_shards(src, tmp_path / "tiny", max_side=200, log=lambda s: None)
    assert not (tmp_path / "tiny").exists(), "refused before writing"


@pytest.mark.slow
def test_presized_shards_train_bit_identically_to_a_folder_of_the_same_reencoded_images(tmp_path):
    from PIL import Image

    from tutorial_lib.transforms import Presizer

    src = make_image_folder(tmp_path / "src", classes=3, train_per_class=8, val_per_class=4, img_size=40)
    for k, path in enumerate(sorted(src.rglob("*.jpg"))):
        if k % 2:  # every other image small enough to be kept as it is
            Image.open(path).resize((16, 16)).save(path, quality=90)
    write_shards(src, tmp_path / "shards", max_side=24, log=lambda s: None)
    presize = Presizer(24)
    for path in sorted(src.rglob("*.jpg")):
        copy = tmp_path / "copy" / path.relative_to(src)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(presize(path.read_bytes()))
    assert presize.counts == {"resized": 18, "kept": 18, "unreadable": 0}
    options = {"img_size": 16, "batch_size": 4, "max_train_samples": None, "max_val_samples": None}
    folder = run(tmp_path, "folder", tmp_path / "copy", **options)
    shards = run(tmp_path, "shards", tmp_path / "shards", **options)
    assert folder["optimizer_steps"] == shards["optimizer_steps"] == 12
    assert bitwise_equal(weights(tmp_path / "folder"), weights(tmp_path / "shards"))


def test_presizer_keeps_a_file_it_cannot_read_and_counts_it():
    from tutorial_lib.transforms import Presizer

    presize, photo = Presizer(100), (PHOTOS / "n01440764_tench.JPEG").read_bytes()
    assert presize(photo[: len(photo) // 2]) == photo[: len(photo) // 2]  # truncated: kept, training names it (07c)
    assert presize(b"not an image") == b"not an image"
    assert presize.counts == {"resized": 0, "kept": 0, "unreadable": 2}
    for bad in [dict(max_side=0), dict(max_side=10, jpeg_quality=101), dict(max_side=2.5)]:
        with pytest.raises(ValueError, match="max_side"):
            Presizer(**bad)


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--jpeg_quality", "80"], "--jpeg_quality applies to re-encoded images: give --max_side too"),
        (["--max_side", "0"], "--max_side must be >= 1, got 0"),
        (["--max_side", "64", "--jpeg_quality", "0"], "--jpeg_quality must be in [1, 100], got 0"),
    ],
)
def test_shard_refuses_bad_presize_flags_in_one_line_before_reading_anything(tmp_path, capsys, flags, line):
    assert exit_status(main, ["shard", str(tmp_path / "missing"), str(tmp_path / "out"), *flags]) == 2
    assert line in capsys.readouterr().err and not (tmp_path / "out").exists()


# --- from-archives: the official ILSVRC2012 archives → folders -----------------------------------------------


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


IDS = {"n02119789": 1, "n01440764": 2, "n02102040": 3}  # devkit numbers, not in sorted wnid order
VAL = ["n02102040", "n02119789", "n01440764", "n02119789", "n02102040"]  # class of ILSVRC2012_val_00000001 …


def make_archives(folder: Path, ids=IDS, train_counts=None, declared=None, val=VAL) -> Path:
    """ILSVRC2012_img_train.tar (a tar of class tars), ILSVRC2012_img_val.tar (flat) and the devkit
    (meta.mat as MATLAB writes it, ancestor synsets included; the ground truth as class numbers)."""
    folder.mkdir(parents=True, exist_ok=True)
    pictures = sorted((EMBEDDED / "val" / "dog").iterdir())
    train_counts = train_counts or {w: 2 + k for k, w in enumerate(ids)}
    declared = declared or train_counts
    fields = [
        "ILSVRC2012_ID",
        "WNID",
        "words",
        "gloss",
        "num_children",
        "children",
        "wordnet_height",
        "num_train_images",
    ]
    synsets = np.zeros((len(ids) + 2, 1), dtype=[(f, "O") for f in fields])
    for row, (wnid, k) in enumerate(sorted(ids.items(), key=lambda item: item[1])):
        synsets[row, 0] = (k, wnid, f"{wnid} words, more words", "gloss", 0, np.zeros(0), 0, declared[wnid])
    n = len(ids)
    synsets[n, 0] = (n + 1, "n00000002", "an ancestor", "gloss", 2, np.array([1, 2]), 1, 0)
    synsets[n + 1, 0] = (n + 2, "n00000001", "entity", "gloss", 1, np.array([n + 1]), 2, 0)
    import scipy.io

    meta = io.BytesIO()
    scipy.io.savemat(meta, {"synsets": synsets})
    with tarfile.open(folder / "ILSVRC2012_devkit_t12.tar.gz", "w:gz") as tar:
        add_bytes(tar, "ILSVRC2012_devkit_t12/COPYING", b"terms")
        add_bytes(tar, "ILSVRC2012_devkit_t12/data/meta.mat", meta.getvalue())
        add_bytes(
            tar,
            "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt",
            "".join(f"{ids[w]}\n" for w in val).encode(),
        )
    k = 0
    with tarfile.open(folder / "ILSVRC2012_img_train.tar", "w") as tar:
        for wnid in ids:
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as class_tar:
                for j in range(train_counts[wnid]):
                    add_bytes(class_tar, f"{wnid}_{1000 + j}.JPEG", pictures[k].read_bytes())
                    k += 1
            add_bytes(tar, f"{wnid}.tar", inner.getvalue())
    with tarfile.open(folder / "ILSVRC2012_img_val.tar", "w") as tar:
        for j in range(len(val)):
            add_bytes(tar, f"ILSVRC2012_val_{j + 1:08d}.JPEG", pictures[50 + j].read_bytes())
    return folder


def fingerprint(folder: Path) -> dict:
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())
    }


def test_from_archives_unpacks_the_layout_verifies_it_and_never_touches_the_archives(tmp_path):
    archives = make_archives(tmp_path / "archives")
    before = fingerprint(archives)
    messages = []
    counts = from_archives(archives, tmp_path / "imagenet", log=messages.append)
    assert counts == {"classes": 3, "train": 2 + 3 + 4, "val": 5}
    assert fingerprint(archives) == before
    assert "needs" in messages[0] and messages[-1].startswith("verified: 3 classes")
    train_ds, val_ds = build_datasets(tmp_path / "imagenet", img_size=16)
    assert train_ds.classes == sorted(IDS) == ["n01440764", "n02102040", "n02119789"]
    truth = {f"ILSVRC2012_val_{k:08d}.JPEG": w for k, w in enumerate(VAL, start=1)}
    assert {Path(p).name: val_ds.classes[y] for p, y in val_ds.samples} == truth
    assert sorted(p.name for p in (tmp_path / "imagenet" / "train" / "n02119789").iterdir()) == [
        "n02119789_1000.JPEG",
        "n02119789_1001.JPEG",
    ]
    assert not list((tmp_path / "imagenet").rglob(".*")), "no temporary folder or file is left"


def test_devkit_is_read_as_torchvision_reads_it(tmp_path, monkeypatch):
    import torchvision.datasets.imagenet as tv

    archives = make_archives(tmp_path / "archives")
    devkit = read_devkit(archives / "ILSVRC2012_devkit_t12.tar.gz")
    assert devkit.wnids == ["n02119789", "n01440764", "n02102040"] and not devkit.official
    md5 = hashlib.md5((archives / "ILSVRC2012_devkit_t12.tar.gz").read_bytes()).hexdigest()
    monkeypatch.setitem(tv.ARCHIVE_META, "devkit", ("ILSVRC2012_devkit_t12.tar.gz", md5))  # accept our test devkit
    tv.parse_devkit_archive(str(archives))
    wnid_to_classes, val_wnids = tv.load_meta_file(str(archives))
    (archives / "meta.bin").unlink()
    assert val_wnids == [devkit.wnids[i - 1] for i in devkit.val_ids] == VAL
    assert wnid_to_classes == {w: tuple(devkit.words[w].split(", ")) for w in devkit.wnids}
    assert devkit.train_counts == {"n02119789": 2, "n01440764": 3, "n02102040": 4}


def test_from_archives_resumes_after_an_interruption_in_train_and_in_val(tmp_path, monkeypatch):
    archives = make_archives(tmp_path / "archives")
    out = tmp_path / "imagenet"
    real_unpack, real_copy = data_module._unpack_class, data_module._copy_member
    calls = {"unpack": 0, "val": 0}

    def unpack_then_stop(train_tar, member, folder):
        calls["unpack"] += 1
        if calls["unpack"] == 2:  # killed while unpacking the second class: one image written
            (folder / "partial.JPEG").write_bytes(b"half")
            raise KeyboardInterrupt
        return real_unpack(train_tar, member, folder)

    monkeypatch.setattr(data_module, "_unpack_class", unpack_then_stop)
    with pytest.raises(KeyboardInterrupt):
        from_archives(archives, out, log=lambda s: None)
    assert [p.name for p in (out / "train").iterdir() if not p.name.startswith(".")] == ["n01440764"]
    assert not (out / "val").exists(), "an unfinished run must not look finished"
    first_class = {p.name: p.stat().st_mtime_ns for p in (out / "train" / "n01440764").iterdir()}

    def copy_then_stop(tar, member, dst):
        if ".tmp-val" in str(dst):
            calls["val"] += 1
            if calls["val"] == 3:
                raise KeyboardInterrupt
        return real_copy(tar, member, dst)

    monkeypatch.setattr(data_module, "_unpack_class", real_unpack)
    monkeypatch.setattr(data_module, "_copy_member", copy_then_stop)
    with pytest.raises(KeyboardInterrupt):
        from_archives(archives, out, log=lambda s: None)
    assert len(list((out / "train").iterdir())) == 3 and not (out / "val").exists()
    monkeypatch.setattr(data_module, "_copy_member", real_copy)
    messages = []
    counts = from_archives(archives, out, log=messages.append)
    assert "already in" in messages[0] and "3 classes" in messages[0]
    assert counts == {"classes": 3, "train": 9, "val": 5}
    assert {p.name: p.stat().st_mtime_ns for p in (out / "train" / "n01440764").iterdir()} == first_class
    assert not list(out.rglob(".*")) and not list(out.rglob("partial.JPEG"))


@pytest.mark.parametrize(
    "case, words",
    [
        ("no devkit", ["ILSVRC2012_devkit_t12.tar.gz", "image-net.org"]),
        ("wrong devkit classes", ["only in the tar", "do not match"]),
        ("val and ground truth differ", ["ground truth", "do not match"]),
        ("disk too small", ["needs", "free"]),
        ("not a devkit", ["not the ILSVRC2012 devkit"]),
    ],
)
def test_from_archives_refuses_user_errors_with_exit_2_before_writing(tmp_path, capsys, monkeypatch, case, words):
    archives = make_archives(tmp_path / "archives")
    if case == "no devkit":
        (archives / "ILSVRC2012_devkit_t12.tar.gz").unlink()
    elif case == "wrong devkit classes":
        other = make_archives(
            tmp_path / "other", ids={"n09999999": 1, "n01440764": 2, "n02102040": 3}, val=["n09999999"] * 5
        )
        (archives / "ILSVRC2012_devkit_t12.tar.gz").write_bytes((other / "ILSVRC2012_devkit_t12.tar.gz").read_bytes())
    elif case == "val and ground truth differ":
        other = make_archives(tmp_path / "other", val=VAL[:4])
        (archives / "ILSVRC2012_img_val.tar").write_bytes((other / "ILSVRC2012_img_val.tar").read_bytes())
    elif case == "disk too small":
        monkeypatch.setattr(data_module.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    elif case == "not a devkit":
        with tarfile.open(archives / "ILSVRC2012_devkit_t12.tar.gz", "w:gz") as tar:
            add_bytes(tar, "readme.txt", b"hello")
    assert exit_status(main, ["from-archives", str(archives), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert not (tmp_path / "out").exists(), "nothing may be written before the checks pass"


def flat_val_of(folder: Path, n: int = len(VAL)) -> Path:
    folder.mkdir(parents=True)
    pictures = sorted((EMBEDDED / "val" / "dog").iterdir())
    for k in range(1, n + 1):
        (folder / f"ILSVRC2012_val_{k:08d}.JPEG").write_bytes(pictures[k].read_bytes())
    return folder


@pytest.mark.parametrize("form", ["archive", "unpacked folder", "ground truth beside meta.mat"])
def test_prepare_val_reads_the_devkit_class_numbers_through_its_meta_mat(tmp_path, form):
    devkit = make_archives(tmp_path / "archives") / "ILSVRC2012_devkit_t12.tar.gz"
    if form != "archive":
        with tarfile.open(devkit) as tar:
            tar.extractall(tmp_path / "unpacked", filter="data")
        devkit = tmp_path / "unpacked" / "ILSVRC2012_devkit_t12"
        if form == "ground truth beside meta.mat":
            devkit = devkit / "data" / "ILSVRC2012_validation_ground_truth.txt"
    val = flat_val_of(tmp_path / "val")
    assert exit_status(main, ["prepare-val", str(val), str(devkit), "--apply"]) == 0
    classes, samples = scan_image_folder(val)
    assert {Path(p).name: classes[y] for p, y in samples} == {
        f"ILSVRC2012_val_{k:08d}.JPEG": w for k, w in enumerate(VAL, start=1)
    }


def test_prepare_val_with_a_devkit_that_does_not_match_changes_nothing(tmp_path, capsys):
    devkit = make_archives(tmp_path / "archives") / "ILSVRC2012_devkit_t12.tar.gz"
    val = flat_val_of(tmp_path / "val", n=len(VAL) - 1)
    before = sorted(p.name for p in val.iterdir())
    assert exit_status(main, ["prepare-val", str(val), str(devkit), "--apply"]) == 2
    err = capsys.readouterr().err
    assert "1 labels have no image (ILSVRC2012_val_00000005)" in err and "nothing was changed" in err
    assert sorted(p.name for p in val.iterdir()) == before


def test_declared_counts_are_verified_and_the_official_devkit_demands_ilsvrc2012s(tmp_path):
    archives = make_archives(tmp_path / "archives", declared={"n02119789": 2, "n01440764": 3, "n02102040": 5})
    with pytest.raises(DataLayoutError, match="the devkit declares 5"):
        from_archives(archives, tmp_path / "damaged", log=lambda s: None)
    from_archives(make_archives(tmp_path / "good"), tmp_path / "imagenet", log=lambda s: None)
    devkit = read_devkit(tmp_path / "good" / "ILSVRC2012_devkit_t12.tar.gz")
    devkit.official = True  # as if it were the archive torchvision knows
    with pytest.raises(DataLayoutError, match="ILSVRC2012 has"):
        verify_unpacked(tmp_path / "imagenet", devkit)


@pytest.mark.slow
def test_data_command_line_runs_shard_and_refuses_from_archives_without_archives(tmp_path, capsys):
    assert (
        exit_status(main, ["shard", str(tiny_tree(tmp_path / "src")), str(tmp_path / "shards"), "--shard_mb", "0.01"])
        == 0
    )
    assert resolve_data_source(tmp_path / "shards").kind == "parquet"
    done = subprocess.run(
        [sys.executable, "-m", "tutorial_lib.data", "from-archives", str(tmp_path / "nothing"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert (
        done.returncode == 2
        and done.stderr.startswith("python -m tutorial_lib.data: error: archive folder")
        and not (tmp_path / "out").exists()
    )


# --- the benchmark -------------------------------------------------------------------------------------------


def test_data_benchmark_reports_parquet_beside_files_and_cleans_up(tmp_path, monkeypatch):
    import tempfile

    src = tiny_tree(tmp_path / "src")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    result = run_data_benchmark(src / "train", workers=0, img_size=32, batch_size=2, repeats=2, rounds=1)
    assert {"parquet_train_ips", "parquet_val_ips", "train_parquet_ratio", "val_parquet_cpu_ratio"} <= set(result)
    assert result["parquet_train_ips"] > 0 and result["images"] == 6
    text = format_data_benchmark(result)
    assert "ours, parquet" in text and "parquet ÷ files" in text
    assert not list((tmp_path / "tmp").iterdir()), "the parquet file and its Arrow copy are deleted"
    without = run_data_benchmark(
        src / "train", workers=0, img_size=32, batch_size=2, repeats=1, rounds=1, parquet=False
    )
    assert "parquet_train_ips" not in without and "ours, parquet" not in format_data_benchmark(without)
