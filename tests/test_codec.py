"""Decoding on TorchCodec (07, 07c, 07e): the same pixels as torchvision's deprecated decoders, on every JPEG the
course ships and on the shared ImageNet photos, the same training batches, no call of the deprecated decoders while
training, a clean fallback where TorchCodec cannot be imported; and the pre-sizer decoding as training decodes."""

import io
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import tutorial_lib.databench as databench
import tutorial_lib.transforms as transforms
from tutorial_lib.core import seed_everything
from tutorial_lib.decoding import _png_decoder, _to_uint8, decode_rgb
from tutorial_lib.loading import build_datasets, build_loaders
from tutorial_lib.sources import embedded_data_path, read_bytes, scan_image_folder
from tutorial_lib.transforms import Presizer, as_stored, decode_fast, exif_orientation, jpeg_decoder

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "tests" / "assets" / "imagenet"
SHARED_PHOTOS = ROOT.parent / "shared" / "data" / "imagenet-sample-100"


def torchvision_decode(data: torch.Tensor) -> torch.Tensor:
    """The decoder the course used before TorchCodec: torchvision's, deprecated since 0.29 (no EXIF turn)."""
    import torchvision.io as tvio

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if bytes(data[:3].tolist()) == b"\xff\xd8\xff":
            return tvio.decode_jpeg(data, mode=tvio.ImageReadMode.RGB)
        img = tvio.decode_png(data, mode=tvio.ImageReadMode.RGB)
        return img if img.dtype == torch.uint8 else _to_uint8(img)


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.fixture
def without_torchcodec(monkeypatch):
    """TorchCodec made unimportable (as on a torch it has no release for), the decoder caches cleared around."""
    transforms.jpeg_decoder.cache_clear()
    _png_decoder.cache_clear()
    monkeypatch.setitem(sys.modules, "torchcodec", None)  # `import torchcodec...` raises ImportError
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    yield
    transforms.jpeg_decoder.cache_clear()
    _png_decoder.cache_clear()


@pytest.fixture(autouse=True)
def fresh_decoders():
    yield
    transforms.jpeg_decoder.cache_clear()
    _png_decoder.cache_clear()


def test_torchcodec_is_the_decoder_here():
    assert jpeg_decoder().func.__module__.startswith("torchcodec"), "torchcodec is a dependency (pyproject.toml)"


def test_every_jpeg_of_the_course_decodes_bit_identically_to_torchvisions_decoder():
    files = sorted(ASSETS.glob("*.JPEG"))  # RGB, grayscale and CMYK photos
    _, samples = scan_image_folder(embedded_data_path() / "val")
    files += [Path(p) for p, _ in samples[::10]]  # 100 of the embedded JPEGs
    assert len(files) >= 105
    for f in files:
        data = read_bytes(f)
        assert torch.equal(decode_fast(data), torchvision_decode(data)), f.name
        assert torch.equal(decode_rgb(data, f), torchvision_decode(data)), f.name


def test_the_shared_imagenet_photos_decode_bit_identically_to_torchvisions_decoder():
    if not SHARED_PHOTOS.is_dir():
        pytest.skip(f"{SHARED_PHOTOS.name} is not beside the course (../shared/data): nothing to compare")
    files = sorted(SHARED_PHOTOS.glob("*.JPEG"))
    assert files
    different = [
        f.name for f in files if not torch.equal(decode_fast(read_bytes(f)), torchvision_decode(read_bytes(f)))
    ]
    assert not different, different


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_an_exif_orientation_tag_leaves_the_pixels_as_stored(fmt):
    """TorchCodec turns an image by its EXIF orientation (torchvision's decoders and PIL do not); 07 plans its crop on
    the header's size, so `as_stored` turns it back, for all eight orientations."""
    pixels = (np.random.default_rng(0).random((40, 64, 3)) * 255).astype(np.uint8)
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, fmt, exif=exif.tobytes())
        data = as_tensor(out.getvalue())
        assert exif_orientation(data) == orientation
        assert torch.equal(decode_rgb(data), torchvision_decode(data)), orientation
        if fmt == "JPEG":
            assert torch.equal(decode_fast(data), torchvision_decode(data)), orientation
            assert jpeg_decoder()(data).shape[-2:] == ((64, 40) if orientation >= 5 else (40, 64))  # turned


def test_pngs_of_every_colour_type_and_depth_decode_bit_identically_to_torchvisions_decoder():
    rng = np.random.default_rng(1)
    rgba = (rng.random((24, 40, 4)) * 255).astype(np.uint8)
    images = {mode: Image.fromarray(rgba).convert(mode) for mode in ["RGB", "RGBA", "L", "LA", "P", "1"]}
    images["I;16"] = Image.fromarray((rng.random((24, 40)) * 65535).astype(np.uint16))
    for mode, im in images.items():
        out = io.BytesIO()
        im.save(out, "PNG")
        data = as_tensor(out.getvalue())
        assert torch.equal(decode_rgb(data), torchvision_decode(data)), mode


def first_batches(n: int = 2) -> list[torch.Tensor]:
    """The first `n` training and validation batches of the fast pipeline on the embedded data (07d)."""
    train, val = build_datasets(embedded_data_path(), img_size=32, pipeline="fast")
    train_loader, val_loader = build_loaders(train, val, batch_size=16, num_workers=0, seed=3)
    seed_everything(0)  # the same crops and flips in both runs
    out = []
    for loader in (train_loader, val_loader):
        for k, (images, labels) in enumerate(loader):
            out += [images, labels]
            if k + 1 == n:
                break
    return out


def test_training_batches_are_identical_with_torchcodec_and_with_the_fallback(capfd, monkeypatch):
    """Bit-identical training before (torchvision's decoder) and after (TorchCodec), and the fallback path: with
    TorchCodec unimportable the course decodes with torchvision's decoder and says so once, in one line."""
    assert jpeg_decoder().func.__module__.startswith("torchcodec")
    with_torchcodec = first_batches()
    monkeypatch.setitem(sys.modules, "torchcodec", None)  # `import torchcodec...` raises ImportError
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    transforms.jpeg_decoder.cache_clear()
    _png_decoder.cache_clear()
    capfd.readouterr()
    with_torchvision = first_batches()
    assert jpeg_decoder().func.__module__.startswith("torchvision")
    for _ in range(3):
        decode_fast(read_bytes(ASSETS / "n01440764_tench.JPEG"))
    said = [line for line in capfd.readouterr().err.splitlines() if "TorchCodec" in line]
    assert said == [
        "TorchCodec is not installed: JPEGs are decoded with torchvision.io.decode_jpeg, deprecated since "
        "torchvision 0.29 (pip install torchcodec)"
    ], said
    assert len(with_torchcodec) == len(with_torchvision) == 8
    for a, b in zip(with_torchcodec, with_torchvision):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_fallback_decodes_pngs_and_exif_tagged_jpegs_as_before(without_torchcodec):
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    Image.fromarray(np.full((8, 16, 3), 90, np.uint8)).save(out, "JPEG", exif=exif.tobytes())
    data = as_tensor(out.getvalue())
    assert torch.equal(decode_fast(data), torchvision_decode(data)) and decode_fast(data).shape == (3, 8, 16)
    out = io.BytesIO()
    Image.fromarray(np.arange(256, dtype=np.uint16).reshape(16, 16) * 257).save(out, "PNG")
    assert torch.equal(decode_rgb(as_tensor(out.getvalue())), torchvision_decode(as_tensor(out.getvalue())))


def test_gpu_decode_drains_the_stream_then_decodes_the_batch_in_one_torchcodec_call(monkeypatch):
    """07e's `decode_jpegs_on_cuda` (10a's GPU path) without a GPU: the stream and TorchCodec's CUDA decoder are
    stand-ins that record the calls and decode on the CPU, as TorchCodec's CUDA decoder turns by EXIF too. The caller's
    stream is drained first (pytorch/vision#9606: nvJPEG may overwrite memory that kernels queued on it still read).
    Its real run needs a CUDA GPU (tests/test_gpu.py)."""
    calls = []

    class RecordingStream:
        def synchronize(self):
            calls.append("synchronize")

    def recording_decoder(batch, device="cpu"):
        calls.append(("decode", len(batch), str(device)))
        return [jpeg_decoder()(x) for x in batch]

    exif = Image.Exif()
    exif[0x0112] = 8
    out = io.BytesIO()
    Image.fromarray((np.random.default_rng(2).random((20, 30, 3)) * 255).astype(np.uint8)).save(
        out, "JPEG", exif=exif.tobytes()
    )
    batch = [read_bytes(ASSETS / "n01440764_tench.JPEG"), as_tensor(out.getvalue())]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: RecordingStream())
    monkeypatch.setattr(databench, "jpeg_decoder", lambda: recording_decoder)
    decoded = databench.decode_jpegs_on_cuda(batch, torch.device("cuda"))
    assert calls == ["synchronize", ("decode", 2, "cuda")]
    assert all(torch.equal(d, torchvision_decode(x)) for d, x in zip(decoded, batch))


def test_exif_orientation_on_cuda_reads_the_first_exif_segment_as_torchcodecs_cuda_decoder_does():
    """TorchCodec's CPU decoder reads the first APP1 segment, its CUDA decoder the first one that starts "Exif"."""
    exif = Image.Exif()
    exif[0x0112] = 3
    out = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(out, "JPEG", exif=exif.tobytes())
    jpeg = out.getvalue()
    xmp = b"http://ns.adobe.com/xap/1.0/\x00<x/>"
    with_xmp_first = jpeg[:2] + b"\xff\xe1" + (len(xmp) + 2).to_bytes(2, "big") + xmp + jpeg[2:]
    data = as_tensor(with_xmp_first)
    assert exif_orientation(data) == -1 and exif_orientation(data, cuda=True) == 3
    assert torch.equal(as_stored(jpeg_decoder()(data), data), torchvision_decode(data))


@pytest.mark.slow
def test_a_training_run_never_calls_torchvisions_deprecated_decoders(tmp_path, monkeypatch):
    """A short training run (the fast pipeline, in this process) with torchvision's decoding deprecation an error
    and its decoders replaced by ones that fail: TorchCodec does all the decoding."""
    import torchvision.io as tvio
    from train_helpers import TINY

    from tutorial_lib.flags import default_args
    from tutorial_lib.train import train

    def deprecated(*args, **kwargs):
        raise AssertionError("torchvision's deprecated decoder was called")

    for name in ["decode_jpeg", "decode_png", "decode_image", "read_file", "read_image"]:
        monkeypatch.setattr(tvio, name, deprecated)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="The image decoding and encoding", category=DeprecationWarning)
        result = train(default_args(**{**TINY, "working_directory": str(tmp_path), "experiment_name": "codec"}))
    assert result is not None


def test_presizing_a_16_bit_grey_png_keeps_its_mean(tmp_path):
    """issue 41, item 4: the pre-sizer decoded with `decode_fast`, whose PIL conversion clipped 16-bit grey to white
    (mean 254 instead of 127.5). Now `pil_to_uint8` scales it as training's decoder (`decode_rgb`) does, and the
    shrunk JPEG keeps the original's mean, with either decoder: measured within 0.002 levels (Lanczos and JPEG on a
    smooth ramp); 0.5 levels allowed."""
    ramp = np.linspace(0, 65535, 600)[None, :].repeat(400, 0).astype(np.uint16)
    out = io.BytesIO()
    Image.fromarray(ramp).save(out, "PNG")
    png = out.getvalue()
    assert Image.open(io.BytesIO(png)).mode == "I;16"
    original = decode_rgb(as_tensor(png)).float().mean().item()
    assert torch.equal(decode_fast(as_tensor(png)), decode_rgb(as_tensor(png)))
    for presize in (Presizer(100), Presizer(100, decode=decode_rgb)):
        small = decode_rgb(as_tensor(presize(png)))
        assert presize.counts["resized"] == 1 and max(small.shape[-2:]) == 100
        assert abs(small.float().mean().item() - original) < 0.5, (small.float().mean().item(), original)


def test_shard_max_side_stores_a_16_bit_grey_png_with_its_mean(tmp_path):
    """The same through `write_shards(max_side=...)` (07b, `shard --max_side`): the stored image keeps the mean."""
    pytest.importorskip("datasets")
    import pyarrow.parquet as pq

    from tutorial_lib.data import write_shards

    ramp = np.linspace(0, 65535, 300)[None, :].repeat(200, 0).astype(np.uint16)
    for split in ("train", "val"):
        folder = tmp_path / "src" / split / "n01440764"
        folder.mkdir(parents=True)
        Image.fromarray(ramp).save(folder / "grey16.JPEG", format="PNG")
    original = decode_rgb(as_tensor((folder / "grey16.JPEG").read_bytes())).float().mean().item()
    write_shards(tmp_path / "src", tmp_path / "out", max_side=64, log=lambda line: None)
    shards = sorted((tmp_path / "out" / "data").glob("*.parquet"))
    assert len(shards) == 2
    for shard in shards:
        stored = pq.read_table(shard).column("image").to_pylist()[0]["bytes"]
        small = decode_rgb(as_tensor(stored))
        assert max(small.shape[-2:]) == 64
        assert abs(small.float().mean().item() - original) < 0.5, (shard.name, small.float().mean().item(), original)


def test_a_truncated_jpeg_is_named_in_one_sentence_without_torchcodecs_full_stop():
    """TorchCodec's messages end with a full stop; the course's line goes on after the reason ("...; delete or
    replace the file"), so the reason loses it."""
    from tutorial_lib.sources import UnreadableImageError

    data = read_bytes(ASSETS / "n01440764_tench.JPEG")
    with pytest.raises(UnreadableImageError) as err:
        decode_rgb(data[: len(data) // 3], "tench.JPEG")
    assert ".;" not in str(err.value) and str(err.value).startswith("cannot decode image tench.JPEG: "), err.value
