"""Data tools and data sources as a hostile user would try them (notebooks 07 and 11b).

`prepare-val` and `from-archives` write only inside their folders, whatever class names a mapping or
a devkit holds, and check every move before the first; parquet splits are compared by the class names
each declares itself; a parquet record is read from its bytes only; errors are one line, with the
libraries' own lines held back; `~` in the data tools' paths is the home folder.

Everything runs offline on the embedded images or images generated here."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports datasets (also inherited by subprocesses)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from train_helpers import CASE_RUN, assert_user_error, exit_status

import tutorial_lib.data as data_module
from tutorial_lib.cli import as_flags
from tutorial_lib.data import main, prepare_val
from tutorial_lib.loading import build_datasets
from tutorial_lib.processes import child_env, make_image_folder, run_cli
from tutorial_lib.sources import (
    DataLayoutError,
    DataSourceError,
    UnreadableImageError,
    embedded_data_path,
    scan_image_folder,
)

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = embedded_data_path()
PICTURES = sorted((EMBEDDED / "val" / "dog").iterdir())


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path_factory, monkeypatch):
    """The Arrow copies of parquet go to a temporary folder, not ~/.cache; no Hub call can happen."""
    import datasets

    cache = tmp_path_factory.getbasetemp() / "hf_datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))


def listing(folder: Path) -> list[tuple[str, int]]:
    """Every path under `folder` with its modification time: what a refused run must leave as it was."""
    return sorted((str(p.relative_to(folder)), p.lstat().st_mtime_ns) for p in folder.rglob("*"))


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("python -m tutorial_lib.data: error: "), (
        f"expected one line 'error: ...', got:\n{err}"
    )
    return lines[0]


# --- prepare-val and from-archives: nothing written outside their folders ---------------------------------------


def devkit_archive(path: Path, wnids: list[str], val_ids: list[int]) -> Path:
    """An ILSVRC2012 devkit archive: meta.mat (as MATLAB writes it) naming `wnids` 1…n, and the ground truth."""
    import scipy.io

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
    synsets = np.zeros((len(wnids), 1), dtype=[(f, "O") for f in fields])
    for k, wnid in enumerate(wnids, start=1):
        synsets[k - 1, 0] = (k, wnid, f"class {k}", "gloss", 0, np.zeros(0), 0, 2)
    meta = io.BytesIO()
    scipy.io.savemat(meta, {"synsets": synsets})
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, data in [
            ("ILSVRC2012_devkit_t12/data/meta.mat", meta.getvalue()),
            (
                "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt",
                "".join(f"{k}\n" for k in val_ids).encode(),
            ),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def flat_val(folder: Path, n: int) -> Path:
    folder.mkdir(parents=True)
    for k in range(1, n + 1):
        shutil.copy(PICTURES[k], folder / f"ILSVRC2012_val_{k:08d}.JPEG")
    return folder


def escapes(tmp_path: Path) -> dict[str, str]:
    """Class names that leave a folder two levels below tmp_path/a: relative and absolute."""
    return {"relative": "../../escaped", "absolute": str(tmp_path / "abs_escaped")}


@pytest.mark.parametrize("mode", ["--apply", "--link --out DIR"])
@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_prepare_val_refuses_devkit_class_names_that_leave_the_folder(tmp_path, capsys, kind, mode):
    """A devkit whose meta.mat names a class `../../escaped` or `/abs/escaped` moves (or links) nothing anywhere."""
    bad = escapes(tmp_path)[kind]
    devkit = devkit_archive(tmp_path / "devkit" / "ILSVRC2012_devkit_t12.tar.gz", ["n01440764", bad], [1, 2, 1, 2])
    val = flat_val(tmp_path / "a" / "b" / "val", 4)
    extra = ["--apply"] if mode == "--apply" else ["--apply", "--link", "--out", str(tmp_path / "a" / "b" / "sorted")]
    before = listing(tmp_path)
    code = exit_status(main, ["prepare-val", str(val), str(devkit), *extra])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and f"meta.mat names class 2 {bad!r}, which cannot be a class folder name" in line, line
    assert listing(tmp_path) == before, "nothing may move, be linked or be created"


@pytest.mark.parametrize("source", ["text mapping", "Kaggle CSV", "dict"])
def test_every_class_name_source_passes_the_same_check(tmp_path, capsys, source):
    """A class name that is a path is refused whether it comes from a text file, a CSV or a dict given to
    prepare_val."""
    val = flat_val(tmp_path / "a" / "b" / "val", 2)
    truth = {"ILSVRC2012_val_00000001": "n01440764", "ILSVRC2012_val_00000002": "../../escaped"}
    before = listing(tmp_path)
    if source == "dict":
        with pytest.raises(DataLayoutError, match="cannot be folders of .* '../../escaped': it is a path"):
            prepare_val(val, truth, apply=True, log=lambda line: None)
    else:
        mapping = tmp_path / ("labels.txt" if source == "text mapping" else "LOC_val_solution.csv")
        mapping.write_text(
            "".join(f"{k}.JPEG {v}\n" for k, v in truth.items())
            if source == "text mapping"
            else "ImageId,PredictionString\n" + "".join(f"{k},{v} 1 2 3 4\n" for k, v in truth.items())
        )
        before = listing(tmp_path)
        assert exit_status(main, ["prepare-val", str(val), str(mapping), "--apply"]) == 2
        assert "'../../escaped' cannot be a class folder name: it is a path" in one_error_line(capsys.readouterr().err)
    assert listing(tmp_path) == before


def test_from_archives_refuses_a_devkit_whose_class_names_leave_the_folder(tmp_path, capsys):
    """The same check on the devkit guards from-archives, which makes folders of its class names too."""
    archives = tmp_path / "archives"
    devkit_archive(archives / "ILSVRC2012_devkit_t12.tar.gz", ["n01440764", "../escaped"], [1, 2])
    for name in ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar"):
        with tarfile.open(archives / name, "w"):
            pass
    assert exit_status(main, ["from-archives", str(archives), str(tmp_path / "out" / "imagenet")]) == 2
    assert "'../escaped', which cannot be a class folder name" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists() and not (tmp_path / "escaped").exists()


def test_prepare_val_refuses_a_class_folder_that_links_elsewhere(tmp_path, capsys):
    """An existing class folder that is a symbolic link would carry the images wherever it points: refused first."""
    val = flat_val(tmp_path / "val", 4)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", val / "n02")
    truth = {
        "ILSVRC2012_val_00000001": "n01",
        "ILSVRC2012_val_00000002": "n02",
        "ILSVRC2012_val_00000003": "n01",
        "ILSVRC2012_val_00000004": "n02",
    }
    before = listing(tmp_path)
    with pytest.raises(DataLayoutError) as caught:
        prepare_val(val, truth, apply=True, log=lambda line: None)
    assert "class folders are symbolic links" in str(caught.value) and "nothing was changed" in str(caught.value)
    assert listing(tmp_path) == before and not list((tmp_path / "elsewhere").iterdir())


@pytest.mark.parametrize("case", ["a file where the last class folder goes", "--out is a file"])
def test_prepare_val_checks_every_move_before_the_first(tmp_path, capsys, case):
    """A conflict met late (a file where the last class folder goes) refuses the run before any image moves."""
    val = flat_val(tmp_path / "val", 4)
    mapping = tmp_path / "labels.txt"
    mapping.write_text("".join(f"ILSVRC2012_val_{k:08d}.JPEG {'n01' if k < 4 else 'n02'}\n" for k in range(1, 5)))
    if case == "--out is a file":
        (tmp_path / "sorted").write_text("a note, not a folder")
        extra, words = ["--link", "--out", str(tmp_path / "sorted")], f"{tmp_path / 'sorted'} is a file, not a folder"
    else:
        (val / "n02").write_text("a note, not a class folder")
        extra, words = [], f"1 class folders are files ({val / 'n02'})"
    before = listing(tmp_path)
    assert exit_status(main, ["prepare-val", str(val), str(mapping), "--apply", *extra]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert words in line and "nothing was changed" in line, line
    assert listing(tmp_path) == before, "no image may have moved or been linked"


def archives_of(folder: Path, wnids=("n01440764", "n02102040"), per_class: int = 2) -> Path:
    """The three official archives, tiny: a train tar of class tars, a flat val tar, the devkit."""
    folder.mkdir(parents=True, exist_ok=True)
    val_ids = [1, 2, 2, 1]
    devkit_archive(folder / "ILSVRC2012_devkit_t12.tar.gz", list(wnids), val_ids)

    def add(tar, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(folder / "ILSVRC2012_img_train.tar", "w") as tar:
        for c, wnid in enumerate(wnids):
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as class_tar:
                for j in range(per_class):
                    add(class_tar, f"{wnid}_{j}.JPEG", PICTURES[c * per_class + j].read_bytes())
            add(tar, f"{wnid}.tar", inner.getvalue())
    with tarfile.open(folder / "ILSVRC2012_img_val.tar", "w") as tar:
        for k in range(1, len(val_ids) + 1):
            add(tar, f"ILSVRC2012_val_{k:08d}.JPEG", PICTURES[20 + k].read_bytes())
    return folder


@pytest.mark.parametrize("leftover", [".tmp-n01440764", ".tmp-val"])
def test_from_archives_unlinks_a_symlinked_leftover_and_never_writes_through_it(tmp_path, capsys, leftover):
    """A `.tmp-*` left in the output that is a link to another folder is removed as a link: the folder it points to
    keeps its files and receives none."""
    archives = archives_of(tmp_path / "archives")
    out = tmp_path / "imagenet"
    precious = tmp_path / "precious"
    (precious / "n01440764").mkdir(parents=True)
    (precious / "keep.txt").write_text("mine")
    where = out / "train" if leftover.startswith(".tmp-n") else out
    where.mkdir(parents=True)
    os.symlink(precious, where / leftover)
    assert exit_status(main, ["from-archives", str(archives), str(out)]) == 0, capsys.readouterr().err
    assert sorted(str(p.relative_to(precious)) for p in precious.rglob("*")) == ["keep.txt", "n01440764"]
    assert (precious / "keep.txt").read_text() == "mine"
    assert not (out / "val").is_symlink() and len(scan_image_folder(out / "val")[1]) == 4


def test_a_leftover_that_cannot_be_removed_is_named(tmp_path, capsys, monkeypatch):
    archives = archives_of(tmp_path / "archives")
    out = tmp_path / "imagenet"
    (out / "train" / ".tmp-n01440764").mkdir(parents=True)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied")  # no file name in the error, as rmtree's own link error

    monkeypatch.setattr(data_module.shutil, "rmtree", refuse)
    assert exit_status(main, ["from-archives", str(archives), str(out)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot remove {out / 'train' / '.tmp-n01440764'}, left by an interrupted run" in line, line


@pytest.mark.parametrize("command", ["prepare-val", "prepare-val --link --out", "shard", "from-archives"])
def test_tilde_in_the_data_tools_paths_is_the_home_folder(tmp_path, capsys, monkeypatch, command):
    """`"~/x"` (quoted, so the shell left it) means $HOME/x in every path argument, as the shell would have
    expanded it."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    if command.startswith("prepare-val"):
        flat_val(home / "val", 2)
        (home / "labels.txt").write_text("ILSVRC2012_val_00000001.JPEG n01\nILSVRC2012_val_00000002.JPEG n02\n")
        extra = ["--link", "--out", "~/sorted"] if "--link" in command else []
        assert exit_status(main, ["prepare-val", "~/val", "~/labels.txt", "--apply", *extra]) == 0, (
            capsys.readouterr().err
        )
        assert len(list(home.glob(f"{'sorted' if extra else 'val'}/n0*/*.JPEG"))) == 2
    elif command == "shard":
        make_image_folder(home / "src", classes=2, train_per_class=2, val_per_class=1)
        assert exit_status(main, ["shard", "~/src", "~/shards"]) == 0, capsys.readouterr().err
        assert len(list((home / "shards" / "data").glob("*.parquet"))) == 2
    else:
        archives_of(home / "archives")
        assert exit_status(main, ["from-archives", "~/archives", "~/imagenet"]) == 0, capsys.readouterr().err
        assert len(scan_image_folder(home / "imagenet" / "val")[1]) == 4
    assert not (tmp_path / "~").exists(), "no folder named '~' in the working directory"


# --- parquet: each split's own class names, bytes only, one line ------------------------------------------------

CLASSES = ["cat", "dog", "frog", "ship"]
SCHEMA = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("label", pa.int64())])


def write_shard(
    path: Path, rows: list[tuple[bytes | None, str | None, int]], names: list[str] | None = CLASSES
) -> Path:
    """One parquet file with the Hub's schema; `names`: the ClassLabel it declares in its schema metadata."""
    features = {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}
    schema = (
        SCHEMA if names is None else SCHEMA.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.table(
            {"image": [{"bytes": b, "path": p} for b, p, _ in rows], "label": [y for *_, y in rows]}, schema=schema
        ),
        path,
    )
    return path


def rows_of(split: str, per_class: int = 3) -> list[tuple[bytes, str, int]]:
    """Embedded images of CLASSES, `per_class` each, as parquet rows."""
    folder = EMBEDDED / ("train" if split == "train" else "val")
    return [
        (p.read_bytes(), p.name, y) for y, c in enumerate(CLASSES) for p in sorted((folder / c).iterdir())[:per_class]
    ]


def parquet_data(root: Path, val_names=CLASSES, train_rows=None, val_rows=None, train_shards=1) -> Path:
    train = train_rows if train_rows is not None else rows_of("train")
    for k in range(train_shards):
        write_shard(root / "data" / f"train-{k:05d}-of-{train_shards:05d}.parquet", train[k::train_shards])
    write_shard(
        root / "data" / "validation-00000-of-00001.parquet",
        val_rows if val_rows is not None else rows_of("validation"),
        val_names,
    )
    return root


OTHER_ORDER = ["dog", "cat", "frog", "ship"]
OTHER_NAMES = ["cat", "dog", "frog", "truck"]


@pytest.mark.parametrize(
    "val_names, words",
    [
        (OTHER_ORDER, "the same 4 class names in another order (label 0 is 'cat' in train, 'dog' in validation)"),
        (
            OTHER_NAMES,
            "other class names (4 in train, 4 in validation; only in train: ['ship'], only in validation: ['truck'])",
        ),
    ],
)
def test_parquet_validation_split_with_other_class_names_is_refused(tmp_path, val_names, words):
    """🤗 datasets gives the validation split the train shard's features; the names its own shards declare are
    compared."""
    source = parquet_data(tmp_path / "pq", val_names=val_names)
    with pytest.raises(DataLayoutError) as caught:
        build_datasets(source, img_size=16)
    message = str(caught.value)
    assert f"the validation shards declare {words}" in message and "\n" not in message, message


def test_parquet_shards_of_one_split_must_declare_the_same_class_names(tmp_path):
    source = parquet_data(tmp_path / "pq", train_shards=2)
    write_shard(source / "data" / "train-00001-of-00002.parquet", rows_of("train")[1::2], OTHER_ORDER)
    with pytest.raises(DataLayoutError, match="shards of one split, declare the same 4 class names in another order"):
        build_datasets(source, img_size=16)


@pytest.mark.slow
def test_training_script_refuses_a_parquet_validation_split_with_other_class_names(tmp_path):
    source = parquet_data(tmp_path / "pq", val_names=OTHER_ORDER)
    done = run_cli(
        as_flags(
            {
                **CASE_RUN,
                "path_to_data": source,
                "working_directory": tmp_path / "runs",
                "experiment_name": "swapped",
            }
        ),
        timeout=180,
    )
    assert_user_error(
        done,
        f"{source}: the validation shards declare the same 4 class names in another order (label 0 "
        "is 'cat' in train, 'dog' in validation), in "
        f"{source / 'data' / 'validation-00000-of-00001.parquet'}: labels would not mean the same "
        "class; write both splits with one list of class names",
    )


def test_parquet_label_out_of_range_is_reported_with_its_real_value(tmp_path):
    rows = rows_of("train")
    rows[5] = (rows[5][0], rows[5][1], 7)  # 4 classes: labels 0…3
    with pytest.raises(DataSourceError) as caught:
        build_datasets(parquet_data(tmp_path / "pq", train_rows=rows), img_size=16)
    message = str(caught.value)
    assert "has 1 labels outside 0…3, e.g. 7 at row 5 of" in message and "no label" not in message, message
    assert "fix the labels or the class names" in message


@pytest.mark.slow
def test_training_script_refuses_a_parquet_label_out_of_range_in_one_line(tmp_path):
    """The refusal comes after datasets converted the shards: its progress bars (thousands of carriage returns in a
    log file) are not printed when stderr is not a terminal, so the line comes alone."""
    rows = rows_of("train")
    rows[5] = (rows[5][0], rows[5][1], 7)
    source = parquet_data(tmp_path / "pq", train_rows=rows)
    done = run_cli(
        as_flags(
            {**CASE_RUN, "path_to_data": source, "working_directory": tmp_path / "runs", "experiment_name": "label7"}
        ),
        timeout=180,
    )
    shard = source / "data" / "train-00000-of-00001.parquet"
    assert_user_error(
        done,
        f"{source} [train] has 1 labels outside 0…3, e.g. 7 at row 5 of {shard} (row 5 of {source} "
        "[train]): its 4 class names number the labels 0…3: fix the labels or the class names",
    )


def test_parquet_row_without_bytes_is_never_read_from_its_path(tmp_path):
    """A row holding only a path names a file on this machine: it is a bad record (named, or skipped on request),
    never opened, even when the path leads to a readable image."""
    secret = tmp_path / "outside" / "secret.jpg"
    secret.parent.mkdir()
    shutil.copy(PICTURES[0], secret)
    rows = rows_of("train")
    rows[2] = (None, str(secret), rows[2][2])
    source = parquet_data(tmp_path / "pq", train_rows=rows)
    strict, _ = build_datasets(source, img_size=16)
    with pytest.raises(UnreadableImageError) as caught:
        strict[2]
    message = str(caught.value)
    assert f"cannot read image {secret} at row 2 of" in message and "holds no image bytes" in message, message
    skip, _ = build_datasets(source, img_size=16, on_bad_file="skip")
    image, label = skip[2]
    assert skip.skipped == 1 and label == rows[3][2], "replaced by the next record, as a bad file is"


@pytest.mark.slow
def test_a_damaged_parquet_file_is_one_line_naming_it_without_the_librarys_own(tmp_path):
    """datasets logs "Failed to read schema from …" before raising: the user sees only the training script's line."""
    source = parquet_data(tmp_path / "pq")
    (source / "data" / "train-00000-of-00001.parquet").write_bytes(b"PAR1 cut short")
    done = run_cli(
        as_flags(
            {
                **CASE_RUN,
                "path_to_data": source,
                "working_directory": tmp_path / "runs",
                "experiment_name": "damaged",
            }
        ),
        timeout=180,
    )
    assert done.returncode == 2 and len(done.stderr_lines) == 1, done.stderr
    assert done.stderr_lines[0].startswith(
        f"tutorial-train: error: cannot read the parquet file {source / 'data' / 'train-00000-of-00001.parquet'}"
    ), done.stderr


@pytest.mark.slow
def test_hub_retry_lines_are_held_back_before_the_one_line(tmp_path):
    """What huggingface_hub logs while it retries an unreachable Hub (replayed here by a stand-in for
    `datasets.load_dataset`, then the failure) does not come before the one line; after a success it is printed."""
    stand_in = (
        "import logging, datasets\n"
        "real = datasets.load_dataset\n"
        "def load_dataset(path, **kwargs):\n"
        "    http = logging.getLogger('huggingface_hub.utils._http')\n"
        "    http.warning(\"'[Errno -2] Name or service not known' thrown while requesting HEAD https://huggingface.co/x\")\n"
        "    http.warning('Retrying in 1s [Retry 1/5].')\n"
        "    logging.getLogger('datasets.load').error('a datasets error line')\n"
        "    if path == 'someone/reachable':\n"
        "        return real('parquet', data_files=FILES, **kwargs)\n"
        "    raise ConnectionError(f\"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)\")\n"
        "datasets.load_dataset = load_dataset\n"
    )
    source = parquet_data(tmp_path / "pq")
    files = {
        "train": str(source / "data" / "train-00000-of-00001.parquet"),
        "validation": str(source / "data" / "validation-00000-of-00001.parquet"),
    }
    script = (
        f"FILES = {files!r}\n{stand_in}import sys\nfrom tutorial_lib.loading import build_datasets\n"
        "from tutorial_lib.train import main\n"
        "if sys.argv[1] == 'reachable':\n    build_datasets('someone/reachable', img_size=16)\n"
        "else:\n    main(sys.argv[2:])\n"
    )
    argv = as_flags(
        dict(
            model="tinycnn",
            img_size=16,
            epochs=1,
            cpu=True,
            log_with="none",
            path_to_data="someone/gone",
            working_directory=tmp_path / "runs",
            experiment_name="hub",
        )
    )
    import tutorial_lib  # the child imports the library this test imported

    env = child_env(
        PYTHONPATH=os.pathsep.join([str(Path(tutorial_lib.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "gone", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=180,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("tutorial-train: error: cannot load someone/gone: Couldn't reach"), done.stderr
    loaded = subprocess.run(
        [sys.executable, "-c", script, "reachable"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180
    )
    assert loaded.returncode == 0, loaded.stderr
    assert "Retrying in 1s [Retry 1/5]." in loaded.stderr and "a datasets error line" in loaded.stderr, loaded.stderr


@pytest.mark.parametrize("out", ["src/train", "src"])
def test_shard_refuses_an_output_folder_inside_its_source_before_writing(tmp_path, capsys, monkeypatch, out):
    # `shard SRC SRC/train` used to be accepted: the shards then became part of the source, which failed to train
    (tmp_path / "src" / "train" / "a").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["shard", "src", out])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.endswith(f"error: {out} is inside src: its shards would become part of the data; write them elsewhere\n")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "src",
        "src/train",
        "src/train/a",
    ]
