"""The CUDA code paths: nvJPEG decoding, the side-stream feed, the training script on a GPU, the
pipeline split over two GPUs.

Skipped without a CUDA GPU (CI has none). `.ci/gpu` runs them with `bench gpu` on a GPU machine.
`TUTORIAL_TEST_DEVICE=cpu` runs the device-generic ones on the CPU, to check the tests themselves."""

import os
import warnings
from pathlib import Path

import pytest
import torch

from tutorial_lib import flags
from tutorial_lib import train as T
from tutorial_lib.accel import read_metrics
from tutorial_lib.bench import decode_on_side_stream
from tutorial_lib.core import seed_everything
from tutorial_lib.databench import decode_batch_on_device, decode_jpegs_on_cuda
from tutorial_lib.loading import build_datasets
from tutorial_lib.sources import embedded_data_path, read_bytes
from tutorial_lib.transforms import jpeg_size

pytestmark = pytest.mark.slow  # starts processes or trains: skipped by `pytest -m "not slow"`

DEVICE = torch.device(os.environ.get("TUTORIAL_TEST_DEVICE", "cuda"))
ASSETS = Path(__file__).resolve().parent / "assets" / "imagenet"
needs_device = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU (or TUTORIAL_TEST_DEVICE=cpu)"
)
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def encoded_val_images(n: int) -> list[torch.Tensor]:
    """`n` JPEGs of the embedded val split as byte tensors (what `pipeline="gpu"` workers yield)."""
    _, val = build_datasets(embedded_data_path(), img_size=32, pipeline="gpu")
    return [val[k][0] for k in range(n)]


@needs_device
def test_device_decode_matches_the_cpu_decode():
    encoded = encoded_val_images(16) + [read_bytes(p) for p in sorted(ASSETS.glob("n*.JPEG"))]
    on_device = decode_batch_on_device(encoded, img_size=64, train=False, device=DEVICE).cpu()
    on_cpu = decode_batch_on_device(encoded, img_size=64, train=False, device="cpu")
    # nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo's by a level or two, not more
    assert on_device.shape == on_cpu.shape == (len(encoded), 3, 64, 64)
    assert (on_device.float() - on_cpu.float()).abs().mean() < 2.0


@needs_device
def test_side_stream_decode_gives_the_same_batch_as_the_current_stream():
    encoded = encoded_val_images(16)
    stream = torch.cuda.Stream(DEVICE) if DEVICE.type == "cuda" else None
    seed_everything(3)
    side = decode_on_side_stream(encoded, 32, DEVICE, stream)
    side_sum = side.sum(dtype=torch.int64)  # read on the current stream: must wait for the side stream
    seed_everything(3)
    here = decode_batch_on_device(encoded, 32, train=True, device=DEVICE)
    assert torch.equal(side, here) and side_sum.item() == here.sum(dtype=torch.int64).item()


@cuda_only
def test_nvjpeg_decode_leaves_memory_that_queued_kernels_still_read_intact():
    """pytorch/vision#9606: free tensors that queued reductions still read, then decode. Without the
    stream drain in `decode_jpegs_on_cuda` the decoder can be handed those blocks and overwrite them."""
    device = torch.device("cuda")
    jpeg = read_bytes(ASSETS / "n01440764_tench.JPEG")
    h, w = jpeg_size(jpeg)
    expected = [(k + 1) * 3 * h * w for k in range(8)]
    wrong = 0
    for _ in range(20):
        slow = torch.randn(4096, 4096, device=device)
        victims = [torch.full((3, h, w), k + 1, dtype=torch.uint8, device=device) for k in range(8)]
        for _ in range(30):  # tens of milliseconds of work queued ahead of the reductions
            slow = torch.tanh(slow @ slow)
        sums = [v.sum(dtype=torch.int64) for v in victims]
        del victims  # back to the allocator while the sums are still queued
        decoded = decode_jpegs_on_cuda([jpeg] * 8, device)
        wrong += [int(s) for s in sums] != expected
        assert all(d.shape == (3, h, w) for d in decoded)
    assert wrong == 0, f"{wrong} of 20 trials read memory the decoder had overwritten"


@needs_device
def test_training_script_runs_bf16_channels_last_ema_and_progressive_resizing_on_the_device(tmp_path):
    args = flags.default_args(
        model="resnet18",
        img_size=32,
        epochs=2,
        batch_size=32,
        max_train_samples=256,
        max_val_samples=64,
        num_workers=2,
        cpu=DEVICE.type == "cpu",
        mixed_precision="bf16",
        channels_last=True,
        ema=True,
        ema_decay=0.9,
        min_res=24,
        max_res=32,
        end_ramp=1,
        res_step=8,
        log_with="none",
        disable_progress_bar=True,
        learning_rate=0.05,
        working_directory=str(tmp_path),
        experiment_name="gpu",
    )
    final = T.train(args)
    rows = read_metrics(tmp_path / "gpu" / "metrics.jsonl")
    assert final["finished"] and final["optimizer_steps"] == 2 * (256 // 32)
    assert [r["train_res"] for r in rows] == [24, 32]
    for r in rows:
        assert all(torch.isfinite(torch.tensor(r[k])) for k in ["train_loss", "val_loss", "ema_val_loss"])
        assert r["peak_memory_mb"] > 0 and r["compute_time"] > 0
    if DEVICE.type == "cuda" and T.peak_flops_for(torch.cuda.get_device_name(), None):
        assert all(0 < r["mfu"] < 1 for r in rows), "a known GPU gets an MFU between 0 and 1"
    assert (tmp_path / "gpu" / "model.safetensors").is_file()


@needs_device
def test_training_script_compiles_with_inductor_on_the_device(tmp_path):
    args = flags.default_args(
        model="tinycnn",
        img_size=16,
        epochs=1,
        batch_size=16,
        max_train_samples=64,
        max_val_samples=40,
        num_workers=0,
        cpu=DEVICE.type == "cpu",
        mixed_precision="bf16",
        compile=True,
        compile_backend="inductor",
        log_with="none",
        disable_progress_bar=True,
        learning_rate=0.05,
        working_directory=str(tmp_path),
        experiment_name="compiled",
    )
    final = T.train(args)
    assert final["finished"] and torch.isfinite(torch.tensor(final["train_loss"]))
    assert final["optimizer_steps"] == 64 // 16


def count_host_syncs(fn) -> int:
    """How many synchronizing CUDA calls `fn()` makes (PyTorch's sync debug mode warns at each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@cuda_only
def test_training_steps_never_wait_for_the_gpu(tmp_path):
    """An epoch of 8 optimizer steps synchronizes exactly as often as one of 4: nothing inside a step
    (data copy, normalization, forward, backward, optimizer, scheduler, metrics, EMA) waits for the GPU."""

    def epoch_of(steps: int):
        args = flags.default_args(
            model="resnet18",
            img_size=32,
            epochs=1,
            batch_size=16,
            max_train_samples=16 * steps,
            max_val_samples=32,
            num_workers=2,
            mixed_precision="bf16",
            channels_last=True,
            ema=True,
            ema_decay=0.9,
            log_interval=0,
            log_with="none",
            disable_progress_bar=True,
            learning_rate=0.05,
            working_directory=str(tmp_path),
            experiment_name=f"sync{steps}",
        )
        return lambda: T.train(args)

    count_host_syncs(epoch_of(2))  # one-time work (CUDA context, kernels, caches) happens here
    counts = {steps: count_host_syncs(epoch_of(steps)) for steps in (4, 8)}
    assert counts[4] == counts[8], f"host syncs per epoch: {counts}: some happen inside every step"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_pipeline_split_over_two_gpus_equals_the_unsplit_model():
    import torchvision

    from tutorial_lib.parallel import PipelineModel, pipeline_devices, resnet_stages

    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval()
    devices = pipeline_devices(2)
    assert [d.index for d in devices] == [0, 1]
    split = PipelineModel(resnet_stages(model), devices, micro_batches=4).eval()
    x = torch.randn(8, 3, 64, 64)
    with torch.no_grad():
        out = split(x.to(devices[0]))
        whole = model.to(devices[0])(x.to(devices[0]))
    assert out.device == devices[1]
    assert torch.allclose(out.to(devices[0]), whole, atol=1e-4), (out.to(devices[0]) - whole).abs().max()
