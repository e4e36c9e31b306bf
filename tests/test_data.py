"""tutorial_lib.data (notebook 07): layout checks, fast vs classic pipelines, bad inputs, prepare-val, loaders.

Everything runs on images generated in tmp_path, on the embedded dataset, or on the five real ImageNet
JPEGs committed in tests/assets/imagenet; only the last test reads ../shared beside the project root (and skips
without it)."""

import gzip
import hashlib
import json
import os
import random
import re
import struct
import subprocess
import sys
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data import DataLoader
from train_helpers import exit_status

from tutorial_lib.data import main, prepare_val, read_val_mapping
from tutorial_lib.databench import (
    decode_batch_on_device,
    format_data_benchmark,
    run_data_benchmark,
)
from tutorial_lib.decoding import EncodedTransform, decode_rgb, load_pil_rgb
from tutorial_lib.loading import (
    SKIPPED_LABEL,
    EpochSeededDataset,
    EpochSeededSampler,
    base_dataset,
    build_datasets,
    build_loaders,
    collate_images,
)
from tutorial_lib.sources import (
    DataLayoutError,
    ScanReport,
    UnreadableImageError,
    embedded_data_path,
    find_split_dirs,
    list_images,
    read_bytes,
    scan_image_folder,
)
from tutorial_lib.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CropParams,
    FastTrainTransform,
    FastValTransform,
    center_crop_params,
    classic_transforms,
    jpeg_size,
    largest_dct_reduction,
    normalize_on_device,
    resized_crop_uint8,
    sample_crop,
)

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "tests" / "assets" / "imagenet"
IMAGENET_SAMPLE = ROOT.parent / "shared" / "data" / "imagenet-sample-100"  # beside the project root
ONE_LEVEL = 1 / 255 / min(IMAGENET_STD)  # one uint8 step after normalisation


# ---------------------------------------------------------------- helpers


def photo_like(h: int = 120, w: int = 160, seed: int = 0) -> np.ndarray:
    """A smooth RGB image with some edges (JPEG-friendly, unlike white noise)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([128 + 100 * np.sin(xx / (7 + 3 * c) + yy / (11 + c) + c) for c in range(3)], axis=-1)
    img[h // 3 : h // 2, w // 4 : w // 2] = rng.integers(0, 256, 3)  # a flat block with sharp edges
    return img.clip(0, 255).astype(np.uint8)


def save(arr_or_img, path: Path, fmt: str = "JPEG", **kw) -> Path:
    img = Image.fromarray(arr_or_img) if isinstance(arr_or_img, np.ndarray) else arr_or_img
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format=fmt, **kw)
    return path


def make_tree(root: Path, classes=("n01", "n02"), per_class: int = 3, splits=("train", "val"), size=(40, 52)) -> Path:
    for split in splits:
        for k, c in enumerate(classes):
            for i in range(per_class):
                save(photo_like(*size, seed=10 * k + i), root / split / c / f"{c}_{i}.JPEG", quality=90)
    return root


def classic_for(pil: Image.Image, p: CropParams, size: int) -> torch.Tensor:
    """What the classic pipeline (PIL RandomResizedCrop + flip + ToTensor + Normalize) gives for crop `p`."""
    out = TF.resized_crop(pil, p.top, p.left, p.height, p.width, [size, size], antialias=True)
    if p.flip:
        out = TF.hflip(out)
    return TF.normalize(TF.to_tensor(out), IMAGENET_MEAN, IMAGENET_STD)


def fast_for(path: Path, p: CropParams, size: int) -> torch.Tensor:
    return normalize_on_device(resized_crop_uint8(decode_rgb(read_bytes(path), path), p, size))


# ---------------------------------------------------------------- fast vs classic

CROPS = [
    CropParams(0, 0, 120, 160),
    CropParams(10, 20, 80, 90, flip=True),
    CropParams(30, 40, 20, 30),
    CropParams(5, 7, 111, 47, flip=True),
]


@pytest.mark.parametrize("params", CROPS, ids=lambda p: f"{p.height}x{p.width}{'-flip' if p.flip else ''}")
@pytest.mark.parametrize("size", [32, 64])
def test_fast_pipeline_normalized_on_device_matches_classic_for_same_crop(tmp_path, params, size):
    path = save(photo_like(), tmp_path / "img.JPEG", quality=95)
    fast, classic = fast_for(path, params, size), classic_for(load_pil_rgb(path), params, size)
    assert fast.shape == classic.shape == (3, size, size) and fast.dtype == classic.dtype == torch.float32
    assert float((fast - classic).abs().max()) <= ONE_LEVEL + 1e-4


@pytest.mark.parametrize("name", sorted(p.name for p in ASSETS.glob("*.JPEG")))
def test_fast_matches_classic_on_real_imagenet_jpegs(name):
    path = ASSETS / name
    pil = load_pil_rgb(path)
    random.seed(1)
    for _ in range(3):
        p = sample_crop(pil.height, pil.width)
        assert float((fast_for(path, p, 224) - classic_for(pil, p, 224)).abs().max()) <= ONE_LEVEL + 1e-4


def test_fast_train_transform_draws_its_crop_with_sample_crop(tmp_path):
    path = save(photo_like(), tmp_path / "img.JPEG")
    transform = FastTrainTransform(48, reduced_decode=False)
    random.seed(3)
    out = transform(read_bytes(path), path)
    random.seed(3)
    p = sample_crop(120, 160)
    assert torch.equal(out, resized_crop_uint8(decode_rgb(read_bytes(path)), p, 48))
    assert float((normalize_on_device(out) - classic_for(load_pil_rgb(path), p, 48)).abs().max()) <= ONE_LEVEL + 1e-4


def test_sample_crop_respects_scale_and_ratio_like_torchvision():
    random.seed(0)
    for _ in range(300):
        p = sample_crop(375, 500)
        assert 0 <= p.top and p.top + p.height <= 375 and 0 <= p.left and p.left + p.width <= 500
        area = p.height * p.width / (375 * 500)
        assert 0.07 <= area <= 1.0 and 3 / 4 - 0.02 <= p.width / p.height <= 4 / 3 + 0.02
    flips = [sample_crop(10, 10).flip for _ in range(400)]
    assert 0.4 < sum(flips) / len(flips) < 0.6


def test_fast_val_is_the_classic_resized_crop_of_the_centre_box(tmp_path):
    path = save(photo_like(150, 200), tmp_path / "img.JPEG")
    pil = load_pil_rgb(path)
    box = center_crop_params(150, 200, 64)
    fast = normalize_on_device(FastValTransform(64, reduced_decode=False)(read_bytes(path), path))
    assert float((fast - classic_for(pil, box, 64)).abs().max()) <= ONE_LEVEL + 1e-4
    # and the box is the one Resize(73) + CenterCrop(64) keeps, to within a sub-pixel shift
    _, classic_val = classic_transforms(64)
    assert float((fast - classic_val(pil)).abs().mean()) < 3 * ONE_LEVEL


def test_center_crop_params_follow_resize_then_center_crop():
    p = center_crop_params(375, 500, 224)  # Resize(256) → 341×256, CenterCrop(224) keeps 87.5 % of the short side
    assert (p.height, p.width) == (328, 328) and abs(p.top - 23.4) < 1 and abs(p.left - 85) < 1
    assert center_crop_params(224, 224, 224, resize_size=224) == CropParams(0, 0, 224, 224)


def test_reduced_decode_only_when_the_crop_stays_at_least_output_size():
    assert largest_dct_reduction(375, 500, 224) == 1
    assert largest_dct_reduction(448, 460, 224) == 2
    assert largest_dct_reduction(900, 1000, 224) == 4
    assert largest_dct_reduction(2000, 1800, 224) == 8
    assert largest_dct_reduction(447, 2000, 224) == 1


def test_reduced_size_decode_is_close_to_full_decode(tmp_path):
    path = save(photo_like(960, 1000), tmp_path / "big.JPEG", quality=92)
    data = read_bytes(path)
    assert jpeg_size(data) == (960, 1000)
    quarter = decode_rgb(data, path, reduce=4)
    assert tuple(quarter.shape) == (3, 240, 250)
    full = FastValTransform(224, reduced_decode=False)(data, path).float()
    reduced = FastValTransform(224, reduced_decode=True)(data, path).float()
    # a different low-pass filter (DCT-domain scaling) and crop edges rounded at half resolution:
    # a few levels of 255 on average on this high-contrast pattern (1-5 on real ImageNet photos)
    assert float((full - reduced).abs().mean()) < 5.0


def test_jpeg_size_reads_the_header_without_decoding(tmp_path):
    for name in sorted(p.name for p in ASSETS.glob("*.JPEG")):
        with Image.open(ASSETS / name) as im:
            assert jpeg_size(read_bytes(ASSETS / name)) == (im.height, im.width), name
    png = save(photo_like(), tmp_path / "x.png", fmt="PNG")
    assert jpeg_size(read_bytes(png)) is None and jpeg_size(b"\xff\xd8") is None


def test_normalize_on_device_uint8_to_float_and_float_passes_through():
    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    y = normalize_on_device(x)
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    assert y.dtype == torch.float32 and torch.allclose(y, (x.float() / 255 - mean) / std, atol=1e-5)
    assert normalize_on_device(y) is y
    z = normalize_on_device(x, channels_last=True)
    assert z.is_contiguous(memory_format=torch.channels_last) and torch.allclose(z, y)
    with pytest.raises(TypeError, match="uint8 or float"):
        normalize_on_device(x.to(torch.int16))


# ---------------------------------------------------------------- bad inputs: decoding


def test_grayscale_jpeg_becomes_three_equal_channels(tmp_path):
    path = save(Image.fromarray(photo_like()).convert("L"), tmp_path / "gray.JPEG")
    img = decode_rgb(read_bytes(path), path)
    assert img.shape == (3, 120, 160) and torch.equal(img[0], img[1]) and torch.equal(img[1], img[2])
    assert load_pil_rgb(path).mode == "RGB"


def test_cmyk_jpeg_becomes_rgb_with_the_original_colours(tmp_path):
    rgb = photo_like()
    path = save(Image.fromarray(rgb).convert("CMYK"), tmp_path / "cmyk.JPEG", quality=95)
    for img in [decode_rgb(read_bytes(path), path), decode_rgb(read_bytes(path), path, reduce=2)]:
        ref = torch.from_numpy(np.array(Image.fromarray(rgb).resize(img.shape[:0:-1]))).permute(2, 0, 1)
        assert img.shape[0] == 3 and float((img.float() - ref.float()).abs().mean()) < 6


def test_png_named_jpeg_is_decoded_by_its_content(tmp_path):
    rgb = photo_like()
    path = save(rgb, tmp_path / "n02105855_2933.JPEG", fmt="PNG")  # ImageNet's one PNG in disguise
    assert torch.equal(decode_rgb(read_bytes(path), path), torch.from_numpy(rgb).permute(2, 0, 1))
    out = FastTrainTransform(32)(read_bytes(path), path)
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
    assert EncodedTransform()(read_bytes(path), path).shape == (3, 120, 160)  # decoded on the CPU for "gpu"


def bad_files(tmp_path: Path) -> dict[str, Path]:
    whole = save(photo_like(), tmp_path / "whole.JPEG").read_bytes()
    files = {
        "truncated": whole[: len(whole) // 2],
        "not an image": b"<html>404 Not Found</html>" * 10,
        "empty": b"",
        "header only": whole[:300],
    }
    out = {}
    for name, content in files.items():
        out[name] = tmp_path / f"{name.replace(' ', '_')}.JPEG"
        out[name].write_bytes(content)
    return out


@pytest.mark.parametrize("kind", ["truncated", "not an image", "empty", "header only"])
def test_unreadable_file_error_names_the_file_and_the_fix(tmp_path, kind):
    path = bad_files(tmp_path)[kind]
    expected = rf"cannot decode image .*{path.name}.*on_bad_file='skip'"
    with pytest.raises(UnreadableImageError, match=expected):
        decode_rgb(read_bytes(path), path)
    with pytest.raises(UnreadableImageError, match=expected):
        load_pil_rgb(path)
    with pytest.raises(UnreadableImageError, match=expected):
        FastTrainTransform(32, decode=decode_rgb)(read_bytes(path), path)  # the datasets' decoder
    if kind in ("truncated", "header only"):  # the gpu pipeline checks JPEGs before sending them to nvjpeg
        with pytest.raises(UnreadableImageError, match=expected):
            EncodedTransform()(read_bytes(path), path)


@pytest.mark.parametrize("pipeline", ["fast", "classic", "gpu"])
def test_dataset_raises_on_a_truncated_file_by_default(tmp_path, pipeline):
    root = make_tree(tmp_path / "data")
    whole = (root / "train" / "n01" / "n01_0.JPEG").read_bytes()
    (root / "train" / "n01" / "n01_0.JPEG").write_bytes(whole[: len(whole) // 2])
    train, _ = build_datasets(root, img_size=16, pipeline=pipeline)
    with pytest.raises(UnreadableImageError, match="n01_0.JPEG"):
        train[0]


def test_skip_policy_replaces_counts_and_reports_the_bad_file(tmp_path, capsys):
    root = make_tree(tmp_path / "data")
    bad = root / "train" / "n01" / "n01_1.JPEG"
    bad.write_bytes(bad.read_bytes()[:200])
    train, _ = build_datasets(root, img_size=16, on_bad_file="skip")
    items = [train[k] for k in range(len(train))] + [train[1]]
    messages = capsys.readouterr().err.splitlines()
    assert len(items) == len(train) + 1 and all(x.shape == (3, 16, 16) for x, _ in items)
    assert items[1][1] == 0  # replaced by the next readable image, n01_2, same class here
    assert train.skipped == 2 and len(messages) == 1, "counted each time, named once"
    assert messages[0].startswith(f"warning: skipped {bad}: ") and "replaced by the next readable file" in messages[0]
    assert "skipped 2 unreadable image(s), 1 distinct file(s)" in train.skip_report()


@pytest.mark.slow
def test_skip_count_is_shared_by_loader_workers(tmp_path):
    root = make_tree(tmp_path / "data", per_class=4)
    for name in ["n01_0.JPEG", "n01_2.JPEG"]:
        (root / "train" / "n01" / name).write_bytes(b"garbage")
    train, val = build_datasets(root, img_size=16, on_bad_file="skip")
    loader = DataLoader(train, batch_size=2, num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches = list(loader)
    assert sum(len(y) for _, y in batches) == len(train) == 8
    assert train.skipped == 2, "each bad file met once, in whichever worker, must be counted once"


def test_all_files_bad_is_an_error_not_an_endless_loop(tmp_path):
    root = make_tree(tmp_path / "data", classes=("n01",), per_class=2)
    for p in (root / "train" / "n01").iterdir():
        p.write_bytes(b"junk")
    train, _ = build_datasets(root, img_size=16, on_bad_file="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnreadableImageError, match="no readable image"):
            train[0]


# ---------------------------------------------------------------- bad inputs: layout


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_missing_path_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        build_datasets(tmp_path / "nowhere")
    assert "does not exist" in one_line(err) and "--path_to_data" in str(err.value)


def test_missing_train_or_val_folder_lists_what_is_there(tmp_path):
    root = make_tree(tmp_path / "a", splits=("train",))
    with pytest.raises(FileNotFoundError) as err:
        find_split_dirs(root)
    assert "no val/ or validation/ folder" in one_line(err) and "it holds: train" in str(err.value)
    root = make_tree(tmp_path / "b", splits=("val",))
    with pytest.raises(FileNotFoundError, match="no train/ folder"):
        find_split_dirs(root)


def test_validation_is_accepted_as_the_val_folder_name(tmp_path):
    root = make_tree(tmp_path / "d", splits=("train", "validation"))
    assert find_split_dirs(root) == (root / "train", root / "validation")


def test_empty_class_folder_is_named(tmp_path):
    root = make_tree(tmp_path / "d")
    (root / "val" / "n03").mkdir()
    with pytest.raises(DataLayoutError) as err:
        build_datasets(root)
    assert "class folder" in one_line(err) and "n03 has no images" in str(err.value)


def test_train_and_val_with_different_classes_are_refused(tmp_path):
    root = make_tree(tmp_path / "d", classes=("n01", "n02"), splits=("train",))
    make_tree(root, classes=("n01", "n03"), splits=("val",))
    with pytest.raises(DataLayoutError) as err:
        build_datasets(root)
    message = one_line(err)
    assert "only in train: ['n02']" in message and "only in val: ['n03']" in message


def test_folder_without_images_is_refused(tmp_path):
    (tmp_path / "d" / "train").mkdir(parents=True)
    (tmp_path / "d" / "val").mkdir()
    with pytest.raises(DataLayoutError) as err:
        build_datasets(tmp_path / "d")
    assert "no images and no class folders" in one_line(err)
    with pytest.raises(DataLayoutError, match="no images"):
        list_images(tmp_path / "d")


def test_flat_val_folder_points_to_prepare_val(tmp_path):
    root = make_tree(tmp_path / "d", splits=("train",))
    save(photo_like(), root / "val" / "ILSVRC2012_val_00000001.JPEG")
    with pytest.raises(DataLayoutError) as err:
        build_datasets(root)
    assert "no class folders" in one_line(err) and "prepare-val" in str(err.value)
    (root / "val" / "n01").mkdir()
    save(photo_like(), root / "val" / "n01" / "x.JPEG")
    with pytest.raises(DataLayoutError, match="mixes 1 loose images"):
        scan_image_folder(root / "val")


def test_invalid_options_are_refused():
    with pytest.raises(ValueError, match="pipeline must be one of"):
        build_datasets(embedded_data_path(), pipeline="turbo")
    with pytest.raises(ValueError, match="on_bad_file must be one of"):
        build_datasets(embedded_data_path(), on_bad_file="ignore")
    train, val = build_datasets(embedded_data_path(), img_size=8)
    with pytest.raises(ValueError, match="lower the batch size"):
        build_loaders(train, val, batch_size=10_000)


# ---------------------------------------------------------------- bad inputs: odd folders


def scan_with_report(folder: Path):
    report = ScanReport(str(folder))
    classes, samples = scan_image_folder(folder, report)
    return classes, samples, report


def test_symlink_loop_in_a_class_folder_is_read_once_and_reported(tmp_path):
    root = make_tree(tmp_path / "data", per_class=3)
    n01 = root / "train" / "n01"
    (n01 / "loop").symlink_to(n01, target_is_directory=True)  # n01/loop/loop/loop/… without end
    (n01 / "deeper").mkdir()
    (n01 / "deeper" / "back_up").symlink_to(n01.parent, target_is_directory=True)  # up to train/ itself
    classes, samples, report = scan_with_report(root / "train")
    assert classes == ["n01", "n02"] and len(samples) == 6, [Path(p).relative_to(root) for p, _ in samples]
    assert len({os.path.realpath(p) for p, _ in samples}) == 6, "each image once"
    assert sorted(os.path.relpath(p, n01) for p in report.revisited) == ["deeper/back_up", "loop"]
    assert "2 folders reached again through a link, read once" in report.line()


def test_a_link_to_another_class_folder_does_not_label_its_images_twice(tmp_path):
    root = make_tree(tmp_path / "data", per_class=2)
    (root / "train" / "n01" / "also_n02").symlink_to(root / "train" / "n02", target_is_directory=True)
    _, samples, report = scan_with_report(root / "train")
    assert sorted((Path(p).name, y) for p, y in samples) == [
        ("n01_0.JPEG", 0),
        ("n01_1.JPEG", 0),
        ("n02_0.JPEG", 1),
        ("n02_1.JPEG", 1),
    ]
    assert report.counts()["revisited"] == 1
    (root / "val" / "n03").symlink_to(root / "val" / "n02", target_is_directory=True)
    with pytest.raises(DataLayoutError) as err:
        scan_image_folder(root / "val")
    assert "n02 and" in one_line(err) and "same folder" in str(err.value)


def test_hidden_files_and_folders_are_left_out_and_counted(tmp_path):
    root = make_tree(tmp_path / "data", per_class=2)
    train = root / "train"
    checkpoints = train / "n01" / ".ipynb_checkpoints"
    save(photo_like(), checkpoints / "n01_0-checkpoint.JPEG")
    save(photo_like(), train / ".ipynb_checkpoints" / "n09" / "x.JPEG")  # a hidden folder beside the classes
    (train / "n02" / ".DS_Store").write_bytes(b"\0" * 8)
    save(photo_like(), train / "n02" / "._n02_0.JPEG")  # what macOS leaves on other file systems
    classes, samples, report = scan_with_report(train)
    assert classes == ["n01", "n02"] and len(samples) == 4
    assert not any("/." in p for p, _ in samples), "nothing under a hidden name is trained on"
    assert report.counts() == {"hidden_files": 2, "hidden_folders": 2, "not_images": 0, "revisited": 0, "unreadable": 0}
    assert "2 hidden files and 2 hidden folders (names starting with '.'" in report.line()


def test_files_that_are_not_images_are_counted_by_kind(tmp_path):
    root = make_tree(tmp_path / "data", per_class=2)
    n01 = root / "train" / "n01"
    save(photo_like(), n01 / "scan.tif", fmt="TIFF")
    save(photo_like(), n01 / "n01_no_extension", fmt="JPEG")
    (root / "train" / "README.txt").write_text("class list")
    (n01 / "broken.JPEG").symlink_to(tmp_path / "nowhere.JPEG")  # a dangling link is a sample: met when loaded
    _, samples, report = scan_with_report(root / "train")
    assert len(samples) == 5 and any(p.endswith("broken.JPEG") for p, _ in samples)
    assert report.counts()["not_images"] == 3
    line = report.line()
    assert line.startswith(
        f"warning: {root / 'train'}: left out 3 files that are not an image by name (.tif, .txt, no extension;"
    ), line
    assert "\n" not in line


def test_build_datasets_prints_one_warning_line_per_split_that_left_something_out(tmp_path, capsys):
    root = make_tree(tmp_path / "data", per_class=2)
    save(photo_like(), root / "val" / "n01" / "scan.tif", fmt="TIFF")
    (root / "val" / "n02" / ".hidden.JPEG").write_bytes(b"x")
    lines = []
    train, val = build_datasets(root, img_size=16, log=lines.append)
    assert lines == [val.left_out.line()] and train.left_out.line() is None
    assert lines[0] == (
        f"warning: {root / 'val'}: left out 1 hidden file (names starting with '.', e.g. "
        "n02/.hidden.JPEG), 1 file that is not an image by name (.tif; e.g. n01/scan.tif; "
        "images end in .jpg/.jpeg/.png/.bmp/.webp)"
    )
    build_datasets(root, img_size=16)  # default: printed on stderr, once
    assert capsys.readouterr().err == lines[0] + "\n"
    build_datasets(root, img_size=16, log=None)
    assert capsys.readouterr().err == ""


def test_list_images_follows_links_but_enters_each_folder_once(tmp_path):
    folder = tmp_path / "photos"
    save(photo_like(), folder / "a.JPEG")
    (folder / "again").symlink_to(folder, target_is_directory=True)
    assert list_images(folder) == [str(folder / "a.JPEG")]


def test_list_images_keeps_the_extensions_asked_and_leaves_out_hidden_names_and_dangling_links(tmp_path):
    folder = tmp_path / "photos"
    for path in [folder / "b" / "x.JPEG", folder / "a-b" / "y.jpg", folder / "a" / "._z.jpg"]:  # ._: macOS's
        save(photo_like(), path)
    save(photo_like(), folder / "a" / "z.png", fmt="PNG")
    save(photo_like(), folder / ".ipynb_checkpoints" / "w.jpg")
    (folder / "empty_class").mkdir()  # harmless: a listing has no classes to refuse
    (folder / "b" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    names = [str(folder / name) for name in ("a-b/y.jpg", "a/z.png", "b/x.JPEG")]  # sorted as strings
    assert list_images(folder) == names
    assert list_images(folder, (".jpg", ".jpeg")) == [names[0], names[2]]
    with pytest.raises(DataLayoutError, match=r"no images \(\.jpg/\.jpeg\) under"):
        list_images(folder / "a", (".jpg", ".jpeg"))


# ---------------------------------------------------------------- bad inputs: skipping, counted and exact


def solid_tree(root: Path, per_class: int = 5, classes=("n01", "n02")) -> dict[str, int]:
    """Images of one flat grey level each (PNG, so exact after any resize): the level names the file."""
    levels = {}
    for split in ("train", "val"):
        for c in classes:
            for i in range(per_class):
                level = 10 + 7 * len(levels)
                path = root / split / c / f"{c}_{i}.png"
                save(np.full((20, 24, 3), level, np.uint8), path, fmt="PNG")
                levels[str(path)] = level
    return levels


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("pipeline", ["fast", "classic", "gpu"])
def test_a_bad_val_image_is_dropped_never_replaced_so_each_image_counts_once(tmp_path, workers, pipeline):
    from tutorial_lib.accel import ClassificationMetrics

    levels = solid_tree(tmp_path / "data")
    bad = tmp_path / "data" / "val" / "n01" / "n01_2.png"
    bad.write_bytes(b"not a png any more")
    train, val = build_datasets(tmp_path / "data", img_size=8, pipeline=pipeline, on_bad_file="skip", log=None)
    _, loader = build_loaders(train, val, batch_size=4, num_workers=workers)
    metrics = ClassificationMetrics(2)
    seen, sizes = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for images, labels in loader:
            sizes.append(len(labels))
            if pipeline == "gpu":  # encoded bytes, decoded and cropped on the device (here the CPU)
                images = decode_batch_on_device(images, 8, train=False, device="cpu")
            keep = labels != SKIPPED_LABEL  # what evaluation does after gathering the batch
            metrics.update(torch.zeros(int(keep.sum()), 2), labels[keep])
            pixels = (
                images[keep] * 0.229 + 0.485 if pipeline == "classic" else images[keep].float() / 255
            )  # undo normalising
            seen += [round(float(x[0].mean()) * 255) for x in pixels]
    expected = sorted(level for path, level in levels.items() if "/val/" in path and path != str(bad))
    assert sizes == [4, 4, 2], "batches keep their size: every process of a multi-process run gathers alike"
    assert metrics.compute()["count"] == len(val) - 1 == 9
    assert sorted(seen) == expected, "every readable val image exactly once, the bad one not at all"
    assert val.skipped == 1 and val.bad_files() == [str(bad)]


@pytest.mark.slow
def test_skips_are_counted_per_epoch_and_named_once_with_persistent_workers(tmp_path, capfd):
    root = make_tree(tmp_path / "data", per_class=4)
    bad = [root / "train" / "n01" / "n01_1.JPEG", root / "train" / "n02" / "n02_3.JPEG"]
    for path in bad:
        path.write_bytes(path.read_bytes()[:150])
    train, val = build_datasets(root, img_size=16, on_bad_file="skip", log=None)
    wrapped = EpochSeededDataset(torch.utils.data.Subset(train, range(len(train))))
    loader, _ = build_loaders(wrapped, val, batch_size=2, num_workers=2)
    assert loader.persistent_workers and base_dataset(loader) is train
    reports = []
    for epoch in range(2):
        wrapped.set_epoch(epoch)
        assert sum(len(y) for _, y in loader) == 8, "training batches stay full: a bad file is replaced"
        reports.append(base_dataset(wrapped).take_skips())
    assert reports == [(2, [str(p) for p in bad]), (2, [])], "counted every epoch, named the first time only"
    assert train.skipped == 4 and train.take_skips() == (0, [])
    err = capfd.readouterr().err
    assert all(err.count(str(p)) == 1 for p in bad), err


def test_seeding_a_sample_touches_only_the_cpu_generator(tmp_path, monkeypatch):
    """torch.manual_seed also seeds every accelerator module; one not yet initialised (always the case
    in a CPU run and in DataLoader workers) records the call with a formatted stack trace, ~1 ms per
    sample: a third of an epoch's time at 32 px. The per-sample seed must seed the CPU generator only."""
    import torch.cuda

    accelerator_seeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: accelerator_seeds.append(seed))
    root = make_tree(tmp_path / "data", per_class=4)
    train, _ = build_datasets(root, img_size=16, log=None)
    wrapped = EpochSeededDataset(train, seed=3)
    before = torch.get_rng_state()
    first = [wrapped[i][0] for i in range(len(wrapped))]
    assert accelerator_seeds == [], "no accelerator generator is seeded per sample"
    assert torch.equal(torch.get_rng_state(), before), "the caller's CPU generator is untouched"
    assert all(torch.equal(a, wrapped[i][0]) for i, a in enumerate(first)), "same seed, same sample"


# ---------------------------------------------------------------- bad inputs: bombs, missing files, 16-bit PNGs


def jpeg_bomb(path: Path, size: int = 20000) -> Path:
    """A real JPEG whose frame header (SOF0) says size × size pixels."""
    data = bytearray(save(photo_like(), path, quality=90).read_bytes())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = size.to_bytes(2, "big") * 2
    path.write_bytes(data)
    assert jpeg_size(bytes(data)) == (size, size)
    return path


def png_bomb(path: Path, size: int = 20000) -> Path:
    """A real PNG whose IHDR says size × size pixels (CRC corrected)."""
    data = bytearray(save(photo_like(), path, fmt="PNG").read_bytes())
    data[16:24] = struct.pack(">II", size, size)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    path.write_bytes(data)
    return path


BOMB_REASON = "its header says"


@pytest.mark.parametrize("make", [jpeg_bomb, png_bomb], ids=["jpeg", "png"])
def test_a_decompression_bomb_is_an_unreadable_image_named_in_every_pipeline(tmp_path, make):
    path = make(tmp_path / "bomb.JPEG")
    expected = (
        rf"cannot decode image {re.escape(str(path))}: its header says .*400,000,000 pixels, over the "
        r"decompression-bomb limit .*on_bad_file='skip'"
    )
    calls = {
        "decode_rgb": lambda: decode_rgb(read_bytes(path), path),
        "fast train": lambda: FastTrainTransform(32, decode=decode_rgb)(read_bytes(path), path),  # as the datasets
        "fast val": lambda: FastValTransform(32, decode=decode_rgb)(read_bytes(path), path),
        "no reduced decode": lambda: FastValTransform(32, reduced_decode=False, decode=decode_rgb)(
            read_bytes(path), path
        ),
        "classic": lambda: load_pil_rgb(path),
        "gpu": lambda: EncodedTransform()(read_bytes(path), path),
    }
    for call in calls.values():
        with pytest.raises(UnreadableImageError, match=expected):
            call()


@pytest.mark.parametrize("pipeline", ["fast", "classic", "gpu"])
def test_bomb_and_missing_files_stop_with_their_name_or_are_counted_skips(tmp_path, pipeline):
    root = make_tree(tmp_path / "data", per_class=3)
    n01 = root / "train" / "n01"
    jpeg_bomb(n01 / "n01_1.JPEG")
    (n01 / "n01_3.JPEG").symlink_to(tmp_path / "moved_away.JPEG")  # a dangling link
    strict, _ = build_datasets(root, img_size=16, pipeline=pipeline, log=None)
    (n01 / "n01_2.JPEG").unlink()  # deleted after the scan
    names = [Path(p).name for p, _ in strict.samples]
    for name, reason in [("n01_1.JPEG", BOMB_REASON), ("n01_2.JPEG", "no such file"), ("n01_3.JPEG", "no such file")]:
        with pytest.raises(UnreadableImageError) as err:
            strict[names.index(name)]
        assert str(n01 / name) in one_line(err) and reason in str(err.value), str(err.value)
    skip, val = build_datasets(root, img_size=16, pipeline=pipeline, on_bad_file="skip", log=None)
    (n01 / "n01_0.JPEG").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        items = [skip[k] for k in range(len(skip))]
    assert len(items) == 6 and skip.skipped == 3 + 2 + 1, "a bad file is counted every time it is met"
    assert [Path(p).name for p in skip.bad_files()] == ["n01_0.JPEG", "n01_1.JPEG", "n01_3.JPEG"]


def png16(array: np.ndarray) -> bytes:
    """A 16-bit RGB PNG (colour type 2, bit depth 16), written by hand: PIL cannot write one."""
    height, width, _ = array.shape

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"".join(b"\0" + array[y].astype(">u2").tobytes() for y in range(height))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def test_16_bit_pngs_named_jpeg_decode_to_8_bit_scaled_not_clipped(tmp_path):
    yy, xx = np.mgrid[0:40, 0:60]
    grey = np.minimum(xx * 1111 + yy * 7, 65535).astype(np.uint16)  # the whole 16-bit range
    rgb = np.stack([grey, 65535 - grey, np.full_like(grey, 257 * 100)], axis=-1)
    grey_path = tmp_path / "grey16.JPEG"
    Image.fromarray(grey).save(grey_path, format="PNG")
    assert Image.open(grey_path).mode == "I;16"
    rgb_path = tmp_path / "rgb16.JPEG"
    rgb_path.write_bytes(png16(rgb))

    def to8(a: np.ndarray) -> np.ndarray:  # round(v · 255 / 65535)
        return ((a.astype(np.int64) * 255 + 32767) // 65535).astype(np.uint8)

    for path, expected in [(grey_path, np.repeat(to8(grey)[..., None], 3, -1)), (rgb_path, to8(rgb))]:
        fast = decode_rgb(read_bytes(path), path).permute(1, 2, 0).numpy()
        assert np.array_equal(fast, expected), path.name
        classic = np.asarray(load_pil_rgb(path)).astype(int)
        # PIL reads 16-bit RGB as the high byte (v >> 8): at most one level below round(v · 255 / 65535)
        assert np.abs(classic - expected).max() <= 1, (path.name, np.abs(classic - expected).max())
    assert decode_rgb(read_bytes(grey_path)).float().mean() < 200, "PIL's convert('RGB') would clip it to white"


# ---------------------------------------------------------------- prepare-val

TRUTH = {
    f"ILSVRC2012_val_{k:08d}": w
    for k, w in enumerate(["n01440764", "n01443537", "n02085620", "n01440764", "n02085620", "n01443537"], start=1)
}


def flat_val(folder: Path, names=TRUTH) -> Path:
    for k, stem in enumerate(names):
        save(photo_like(24, 30, seed=k), folder / f"{stem}.JPEG")
    return folder


def kaggle_csv(path: Path, truth=TRUTH) -> Path:
    path.write_text("ImageId,PredictionString\n" + "".join(f"{s},{w} 1 2 3 4 {w} 5 6 7 8\n" for s, w in truth.items()))
    return path


def test_both_mapping_formats_read_the_same(tmp_path):
    text = tmp_path / "labels.txt"
    text.write_text("# filename wnid\n" + "".join(f"{s}.JPEG {w}\n" for s, w in TRUTH.items()))
    assert read_val_mapping(kaggle_csv(tmp_path / "LOC_val_solution.csv")) == read_val_mapping(text) == TRUTH


def test_mapping_with_class_numbers_or_conflicts_is_refused(tmp_path):
    numbers = tmp_path / "ILSVRC2012_validation_ground_truth.txt"
    numbers.write_text("a.JPEG 65\nb.JPEG 970\n")
    with pytest.raises(ValueError, match="class number.*LOC_val_solution.csv"):
        read_val_mapping(numbers)
    conflict = tmp_path / "conflict.txt"
    conflict.write_text("a.JPEG n01\na n02\n")
    with pytest.raises(ValueError, match="labelled both n01 and n02"):
        read_val_mapping(conflict)


def test_prepare_val_dry_run_then_apply_then_idempotent(tmp_path):
    val = flat_val(tmp_path / "val")
    before = sorted(p.name for p in val.iterdir())
    logs = []
    dry = prepare_val(val, kaggle_csv(tmp_path / "m.csv"), log=logs.append)
    assert dry == {"images": 6, "classes": 3, "to_move": 6, "already_in_place": 0, "applied": False}
    assert sorted(p.name for p in val.iterdir()) == before and "dry run" in logs[-1]
    done = prepare_val(val, tmp_path / "m.csv", apply=True, log=logs.append)
    assert done["applied"] and done["to_move"] == 6
    classes, samples = scan_image_folder(val)
    assert classes == ["n01440764", "n01443537", "n02085620"]
    assert all(TRUTH[Path(p).stem] == classes[i] for p, i in samples) and len(samples) == 6
    again = prepare_val(val, tmp_path / "m.csv", apply=True, log=logs.append)
    assert again == {"images": 6, "classes": 3, "to_move": 0, "already_in_place": 6, "applied": False}


def test_prepare_val_resumes_a_half_done_run(tmp_path):
    val = flat_val(tmp_path / "val")
    first = next(iter(TRUTH))
    (val / TRUTH[first]).mkdir()
    (val / f"{first}.JPEG").rename(val / TRUTH[first] / f"{first}.JPEG")
    counts = prepare_val(val, TRUTH, apply=True, log=lambda *a: None)
    assert counts["already_in_place"] == 1 and counts["to_move"] == 5
    assert len(scan_image_folder(val)[1]) == 6


def test_prepare_val_link_mode_keeps_the_originals(tmp_path):
    val = flat_val(tmp_path / "val")
    with pytest.raises(ValueError, match="needs --out"):
        prepare_val(val, TRUTH, apply=True, link=True)
    out = tmp_path / "val_sorted"
    counts = prepare_val(val, TRUTH, apply=True, link=True, out_dir=out, log=lambda *a: None)
    assert counts["to_link"] == 6 and len(list(val.glob("*.JPEG"))) == 6
    links = list(out.glob("*/*.JPEG"))
    assert len(links) == 6 and all(p.is_symlink() and p.resolve().parent == val.resolve() for p in links)
    assert prepare_val(val, TRUTH, link=True, out_dir=out, log=lambda *a: None)["already_in_place"] == 6


@pytest.mark.parametrize("case", ["image without label", "label without image", "image in wrong folder"])
def test_prepare_val_refuses_a_mismatch_and_changes_nothing(tmp_path, case):
    val = flat_val(tmp_path / "val")
    truth = dict(TRUTH)
    if case == "image without label":
        truth.pop("ILSVRC2012_val_00000003")
        expected = "1 images have no label (ILSVRC2012_val_00000003)"
    elif case == "label without image":
        truth["ILSVRC2012_val_00000099"] = "n01440764"
        expected = "1 labels have no image (ILSVRC2012_val_00000099)"
    else:
        (val / "n09999999").mkdir()
        (val / "ILSVRC2012_val_00000002.JPEG").rename(val / "n09999999" / "ILSVRC2012_val_00000002.JPEG")
        expected = "1 images sit in the wrong class folder (ILSVRC2012_val_00000002)"
    before = sorted(str(p.relative_to(val)) for p in val.rglob("*"))
    with pytest.raises(DataLayoutError) as err:
        prepare_val(val, kaggle_csv(tmp_path / "m.csv", truth), apply=True)
    assert expected in one_line(err) and "nothing was changed" in str(err.value)
    assert sorted(str(p.relative_to(val)) for p in val.rglob("*")) == before


@pytest.mark.slow
def test_prepare_val_command_line(tmp_path):
    val = flat_val(tmp_path / "val")
    csv_path = kaggle_csv(tmp_path / "LOC_val_solution.csv")

    def run(*args) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tutorial_lib.data", "prepare-val", *map(str, args)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )

    dry = run(val, csv_path)
    assert dry.returncode == 0 and "to move: 6" in dry.stdout and "dry run" in dry.stdout
    assert len(list(val.glob("*.JPEG"))) == 6
    bad = run(tmp_path / "nowhere", csv_path)
    assert (
        bad.returncode == 2
        and bad.stderr.startswith("python -m tutorial_lib.data: error: validation folder")
        and bad.stderr.count("\n") == 1
    )


def test_prepare_val_with_its_arguments_swapped_says_so(tmp_path):
    val = flat_val(tmp_path / "val")
    with pytest.raises(NotADirectoryError) as err:
        prepare_val(kaggle_csv(tmp_path / "m.csv"), val)
    assert "is a file, not the validation folder" in one_line(err) and "VAL_DIR MAPPING" in str(err.value)


def test_main_applies_and_returns_2_on_a_mismatch(tmp_path, capsys):
    val = flat_val(tmp_path / "ok")
    assert exit_status(main, ["prepare-val", str(val), str(kaggle_csv(tmp_path / "m.csv")), "--apply"]) == 0
    assert "moved 6 images into 3 class folders" in capsys.readouterr().out
    val = flat_val(tmp_path / "val")
    text = tmp_path / "labels.txt"
    text.write_text("ILSVRC2012_val_00000001.JPEG n01440764\n")
    assert exit_status(main, ["prepare-val", str(val), str(text), "--apply"]) == 2
    assert "disagree" in capsys.readouterr().err and len(list(val.glob("*.JPEG"))) == 6


def listing(folder: Path) -> list[tuple[str, int]]:
    """Every path under `folder` with its modification time: what a refused run must leave as it was."""
    return sorted((str(p.relative_to(folder)), p.lstat().st_mtime_ns) for p in folder.rglob("*"))


def test_a_csv_with_a_byte_order_mark_is_read_as_without(tmp_path):
    bom = tmp_path / "LOC_val_solution.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + kaggle_csv(tmp_path / "plain.csv").read_bytes())  # as spreadsheets save CSV
    assert read_val_mapping(bom) == TRUTH
    val = flat_val(tmp_path / "val")
    assert exit_status(main, ["prepare-val", str(val), str(bom), "--apply"]) == 0
    assert len(scan_image_folder(val)[1]) == 6


def test_a_gzip_compressed_mapping_is_read_as_is(tmp_path):
    text = "".join(f"{s}.JPEG {w}\n" for s, w in TRUTH.items()).encode()
    (tmp_path / "labels.txt.gz").write_bytes(gzip.compress(text))
    (tmp_path / "LOC_val_solution.csv.gz").write_bytes(gzip.compress(kaggle_csv(tmp_path / "m.csv").read_bytes()))
    assert (
        read_val_mapping(tmp_path / "labels.txt.gz") == read_val_mapping(tmp_path / "LOC_val_solution.csv.gz") == TRUTH
    )


def unusable_mapping(tmp_path: Path, case: str) -> Path:
    if case == "unbalanced quote":
        path = kaggle_csv(tmp_path / "LOC_val_solution.csv")
        lines = path.read_text().splitlines()
        lines[3] = lines[3].replace(",", ',"', 1)  # line 4: ILSVRC2012_val_00000003,"n02085620 1 2 …
        path.write_text("\n".join(lines) + "\n")
    elif case == "a folder":
        path = tmp_path / "labels"
        path.mkdir()
        kaggle_csv(path / "LOC_val_solution.csv")
    elif case == "devkit ground truth":
        path = tmp_path / "ILSVRC2012_validation_ground_truth.txt"
        path.write_text("".join(f"{k}\n" for k in (490, 361, 171, 822, 297, 482)))
    elif case == "zip archive":
        path = tmp_path / "imagenet-object-localization-challenge.zip"
        with zipfile.ZipFile(path, "w") as archive:
            archive.write(kaggle_csv(tmp_path / "m.csv"), "LOC_val_solution.csv")
    elif case == "damaged gzip":
        path = tmp_path / "labels.txt.gz"
        path.write_bytes(gzip.compress(b"ILSVRC2012_val_00000001.JPEG n01440764\n" * 50)[:40])
    else:  # not text
        path = tmp_path / "labels.txt"
        path.write_bytes(bytes(range(128, 256)) * 4)
    return path


@pytest.mark.parametrize(
    "case, words",
    [
        ("unbalanced quote", ["LOC_val_solution.csv:4: a stray or unbalanced quote"]),
        ("a folder", ["is a folder, not a mapping file", "LOC_val_solution.csv"]),
        ("devkit ground truth", ["one class number per line", "meta.mat", "ILSVRC2012_devkit_t12.tar.gz as MAPPING"]),
        ("zip archive", ["is a zip archive, not a text file", "unzip"]),
        ("damaged gzip", ["is a damaged gzip file"]),
        ("not text", ["is not a text file", "not UTF-8"]),
    ],
)
def test_prepare_val_refuses_an_unusable_mapping_with_one_line_and_changes_nothing(tmp_path, capsys, case, words):
    val = flat_val(tmp_path / "val")
    mapping = unusable_mapping(tmp_path, case)
    before = listing(tmp_path)
    for extra in ([], ["--apply"], ["--apply", "--link", "--out", str(tmp_path / "linked")]):
        assert exit_status(main, ["prepare-val", str(val), str(mapping), *extra]) == 2
        err = capsys.readouterr().err
        assert (
            err.count("\n") == 1
            and err.startswith(f"python -m tutorial_lib.data: error: {mapping}")
            and all(w in err for w in words)
        ), err
        assert listing(tmp_path) == before, "a refused run changes nothing"


# ---------------------------------------------------------------- embedded dataset, loaders


def test_embedded_dataset_loads_in_both_pipelines():
    root = embedded_data_path()
    train, val = build_datasets(root, img_size=32)
    assert (
        train.classes
        == val.classes
        == ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    )
    assert len(train) == 4000 and len(val) == 1000
    assert np.bincount(train.targets).tolist() == [400] * 10 and np.bincount(val.targets).tolist() == [100] * 10
    x, y = train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.uint8 and y == 0
    c_train, c_val = build_datasets(root, img_size=32, pipeline="classic")
    assert c_val[999][0].dtype == torch.float32 and c_val[999][1] == 9


def test_embedded_dataset_bytes_match_its_readme():
    root = embedded_data_path()
    readme = (root / "README.md").read_text()
    digest = hashlib.sha256()
    for p in sorted(root.rglob("*.jpg"), key=lambda p: p.relative_to(root).as_posix()):
        digest.update(p.read_bytes())
    assert digest.hexdigest() in readme


@pytest.mark.slow
def test_train_loader_order_depends_only_on_seed_and_epoch():
    train, val = build_datasets(embedded_data_path(), img_size=8)
    train_loader, val_loader = build_loaders(train, val, batch_size=64, seed=7)
    assert train_loader.drop_last and len(train_loader) == 4000 // 64
    sampler = train_loader.sampler
    epochs = [list(sampler) for _ in range(3)]
    assert epochs[0] != epochs[1] != epochs[2] and sorted(epochs[0]) == list(range(4000))
    resumed = build_loaders(train, val, batch_size=64, seed=7)[0].sampler
    resumed.set_epoch(2)
    assert list(resumed) == epochs[2]
    other_seed = EpochSeededSampler(4000, seed=8)
    assert list(other_seed) != epochs[0]
    labels = torch.cat([y for _, y in val_loader])
    assert labels.tolist() == val.targets.tolist() and not val_loader.drop_last, "val: every image, in order"


def test_fast_batches_arrive_channels_last_with_the_same_values():
    train, val = build_datasets(embedded_data_path(), img_size=16)
    samples = [val[k] for k in range(5)]
    images, labels = collate_images(samples)
    reference = torch.stack([x.contiguous() for x, _ in samples])
    assert images.is_contiguous(memory_format=torch.channels_last) and torch.equal(images, reference)
    assert labels.dtype == torch.int64 and labels.tolist() == [y for _, y in samples]
    assert normalize_on_device(images).is_contiguous(), "channels_last=False gives a contiguous NCHW batch"
    assert normalize_on_device(images, channels_last=True).is_contiguous(memory_format=torch.channels_last)
    floats, _ = collate_images([(torch.rand(3, 4, 4), 0), (torch.rand(3, 4, 4), 1)])
    assert floats.shape == (2, 3, 4, 4) and floats.is_contiguous()


def test_resized_crop_keeps_the_decoders_hwc_layout_and_pixels():
    img = decode_rgb(read_bytes(ASSETS / "n01440764_tench.JPEG"))
    assert img.permute(1, 2, 0).is_contiguous()  # the decoder writes HWC
    for p in [CropParams(10, 20, 200, 150), CropParams(0, 0, 90, 300, flip=True)]:
        out = resized_crop_uint8(img, p, 64)
        assert out.shape == (3, 64, 64) and out.permute(1, 2, 0).is_contiguous(), out.stride()
        assert torch.equal(out, resized_crop_uint8(img.contiguous(), p, 64)), "layout must not change the pixels"


def _stack_in_worker(batch):
    """Collate of the next test: the batch and whether it was built in shared memory (in the worker)."""
    images = collate_images(batch)[0]
    return images, images.untyped_storage().is_shared()


@pytest.mark.slow
def test_worker_stacks_fast_batches_straight_into_shared_memory():
    train, val = build_datasets(embedded_data_path(), img_size=16)
    loader = DataLoader(val, batch_size=4, num_workers=1, collate_fn=_stack_in_worker)
    images, shared_in_worker = next(iter(loader))
    assert shared_in_worker, "a worker's batch should be written into shared memory directly (no second copy)"
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(images, torch.stack([val[k][0] for k in range(4)]))
    assert not collate_images([val[0], val[1]])[0].untyped_storage().is_shared()  # main process: plain memory


def test_loader_options_follow_the_worker_count():
    train, val = build_datasets(embedded_data_path(), img_size=8)
    loader, _ = build_loaders(train, val, batch_size=8, num_workers=2, prefetch_factor=3)
    assert loader.persistent_workers and loader.prefetch_factor == 3 and loader.num_workers == 2
    assert loader.pin_memory == torch.cuda.is_available()
    loader0, _ = build_loaders(train, val, batch_size=8)
    assert not loader0.persistent_workers and loader0.num_workers == 0


@pytest.mark.slow
def test_accelerate_prepared_loader_sets_the_sampler_epoch():
    from accelerate import Accelerator

    train, val = build_datasets(embedded_data_path(), img_size=8)
    loader, _ = build_loaders(train, val, batch_size=500, seed=3)
    prepared = Accelerator(cpu=True).prepare(loader)
    first = [y.tolist() for _, y in prepared]
    second = [y.tolist() for _, y in prepared]
    prepared.set_epoch(1)  # what a resumed run does
    resumed = [y.tolist() for _, y in prepared]
    expected = EpochSeededSampler(4000, seed=3)
    expected.set_epoch(1)
    order = list(expected)
    assert first != second and second == resumed
    assert sum(second, []) == [train.targets[i] for i in order[: len(prepared) * 500]]


def test_gpu_pipeline_yields_bytes_and_decodes_like_the_fast_pipeline():
    train, val = build_datasets(embedded_data_path(), img_size=32, pipeline="gpu")
    _, val_loader = build_loaders(train, val, batch_size=16)
    encoded, labels = next(iter(val_loader))
    assert isinstance(encoded, list) and all(x.dim() == 1 for x in encoded) and labels.shape == (16,)
    batch = decode_batch_on_device(encoded, img_size=32, train=False, device="cpu")
    fast = torch.stack([FastValTransform(32)(read_bytes(p), p) for p, _ in val.samples[:16]])
    assert batch.dtype == torch.uint8 and torch.equal(batch, fast)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            decode_batch_on_device(encoded, img_size=32, train=True, device="cuda")


def test_normalization_constants_are_made_once_per_device():
    """Building mean/std from Python lists in every step would be a blocking host-to-GPU copy per step."""
    from tutorial_lib.transforms import imagenet_mean_std_255

    images = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    imagenet_mean_std_255.cache_clear()
    with torch.inference_mode():  # first made during evaluation ...
        first = imagenet_mean_std_255(images.device)
    assert not first[0].is_inference(), "... still an ordinary tensor for training"
    out = normalize_on_device(images)
    assert imagenet_mean_std_255(torch.device("cpu"))[0] is first[0], "cached, not rebuilt"
    mean = torch.tensor(IMAGENET_MEAN).view(-1, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD).view(-1, 1, 1) * 255
    assert torch.allclose(out, (images.float() - mean) / std)


# ---------------------------------------------------------------- benchmark


@pytest.mark.slow
def test_run_data_benchmark_reports_the_four_rates(tmp_path):
    folder = tmp_path / "imgs"
    for k in range(4):
        save(photo_like(150, 200, seed=k), folder / f"{k}.JPEG")
    result = run_data_benchmark(folder, workers=0, img_size=64, batch_size=2, repeats=1, rounds=1)
    with_worker = run_data_benchmark(folder, workers=1, img_size=64, batch_size=2, repeats=1, rounds=1)
    assert with_worker["ours_train_ips"] > 0 and with_worker["workers"] == 1  # CPU time read from the worker
    for key in ["baseline_train_ips", "ours_train_ips", "baseline_val_ips", "ours_val_ips"]:
        assert result[key] > 0 and result[key.replace("_ips", "_cpu_ips")] > 0  # wall clock and CPU time
    text = format_data_benchmark(result)
    assert json.loads(text.splitlines()[-1]) == result and "speed-up" in text


# ---------------------------------------------------------------- real ImageNet JPEGs


def test_committed_real_imagenet_jpegs_decode_to_rgb_in_every_pipeline():
    names = sorted(p.name for p in ASSETS.glob("*.JPEG"))
    assert len(names) == 5 and "n03908714_pencil_sharpener.JPEG" in names
    modes = {}
    for name in names:
        path = ASSETS / name
        with Image.open(path) as im:
            modes[name] = im.mode
        pil = np.array(load_pil_rgb(path))
        img = decode_rgb(read_bytes(path), path)
        assert img.shape[0] == 3 and float(np.abs(img.permute(1, 2, 0).numpy().astype(int) - pil).mean()) < 1, name
        random.seed(0)
        assert FastTrainTransform(224)(read_bytes(path), path).shape == (3, 224, 224)
        assert FastValTransform(224)(read_bytes(path), path).shape == (3, 224, 224)
        assert all(t(load_pil_rgb(path)).shape == (3, 224, 224) for t in classic_transforms(224))
    assert modes["n03908714_pencil_sharpener.JPEG"] == "L" and modes["cmyk_from_n04367480_swab.JPEG"] == "CMYK"


@pytest.mark.slow
def test_every_image_of_imagenet_sample_100_loads_without_error():
    if not IMAGENET_SAMPLE.is_dir():
        pytest.skip(f"{IMAGENET_SAMPLE} not present (a fresh clone lacks it)")
    files = list_images(IMAGENET_SAMPLE)
    assert len(files) == 100
    train_fast, val_fast = FastTrainTransform(224), FastValTransform(224)
    train_classic, val_classic = classic_transforms(224)
    for f in files:
        data = read_bytes(f)
        assert train_fast(data, f).shape == val_fast(data, f).shape == (3, 224, 224)
        pil = load_pil_rgb(f)
        assert train_classic(pil).shape == val_classic(pil).shape == (3, 224, 224)


def test_a_class_folder_that_cannot_be_listed_is_named_as_such_not_as_empty(tmp_path, monkeypatch):
    # it used to be reported as having no images, with the advice to delete it (it held 8); the permission is faked
    # because this test may run as root, whom no mode keeps out
    for name in ("a", "b"):
        (tmp_path / "train" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "train" / name / "x.JPEG")
    locked, scandir = str(tmp_path / "train" / "b"), os.scandir

    def refusing(path="."):
        if os.fspath(path) == locked:
            raise PermissionError(13, "Permission denied", locked)
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    with pytest.raises(DataLayoutError) as refused:
        scan_image_folder(tmp_path / "train")
    assert str(refused.value) == (
        f"class folder {locked} cannot be listed (permission denied): give this user read access to it "
        "(e.g. chmod -R a+rX) and run again"
    )
