"""Tests of tutorial_lib.timing (10) and tutorial_lib.bench (10a): MFU arithmetic, honest timing, step-time accounting,
the loop-overhead harness, and the GPU benchmark's code path on CPU (and its refusal without CUDA).
The measuring tools and fast-recipe helpers that the training script uses (StepTimer, MFU, FLOP count,
peak table, progressive_resolution, resize_batch, make_ema) are exported by notebook 08b (tutorial_lib.train);
notebook 10 measures with them, so their tests import them from there."""

import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torchvision

from tutorial_lib.bench import (
    DRY_RUN,
    RepeatDataset,
    build_synthetic_run,
    format_gpu_table,
    jpeg_batches,
    jpeg_files_and_labels,
    linked_image_folder,
    measure_steps,
    run_gpu_benchmark,
    run_loop_benchmark,
)
from tutorial_lib.core import StepTimer, count_training_flops, mfu, mfu_unknown_note, peak_flops_for
from tutorial_lib.timing import (
    alternate,
    make_bare_step,
    median_interval,
    median_throughput,
    overhead_ratio,
    paired_ratios,
    time_windows,
)

ROOT = Path(__file__).resolve().parents[1]


def run_module(*args, env_extra=None, check=True):
    """Run `python -m tutorial_lib.bench ...` in a subprocess from the repository root."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "tutorial_lib.bench", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=check,
        timeout=300,
    )


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory):
    """A flat folder of small JPEGs named like ImageNet samples, one of them grayscale."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("jpegs")
    g = torch.Generator().manual_seed(0)
    for k in range(6):
        h, w = 40 + 8 * k, 56 - 4 * k
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
        image = Image.fromarray(pixels)
        if k == 5:
            image = image.convert("L")
        image.save(folder / f"n0{k % 3}_thing{k}.JPEG", quality=90)
    return folder


# ---- 1. the physical limit ----------------------------------------------------------------------


def test_peak_table_knows_h200_h100_a100_and_prefers_the_most_specific_name():
    assert peak_flops_for("NVIDIA H200") == 989e12
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for("NVIDIA A10") == 125e12
    assert peak_flops_for("NVIDIA L40S") == 362e12 and peak_flops_for("NVIDIA L4") == 121e12


def test_peak_table_knows_the_gpus_of_free_notebooks_and_clouds_by_their_cuda_names():
    # the names torch.cuda.get_device_name returns on Colab, Kaggle and the clouds
    assert peak_flops_for("Tesla T4") == 65e12  # fp16: no bf16 before Ampere
    assert peak_flops_for("Tesla V100-SXM2-16GB") == 125e12
    assert peak_flops_for("Tesla V100-PCIE-32GB") == 112e12 and peak_flops_for("Tesla V100S-PCIE-32GB") == 130e12
    assert peak_flops_for("NVIDIA L40") == 181e12 and peak_flops_for("NVIDIA H200 NVL") == 835e12
    assert peak_flops_for("NVIDIA A100-PCIE-40GB") == 312e12


def test_a_gpu_without_a_datasheet_peak_reports_mfu_unknown_and_says_why():
    assert peak_flops_for("NVIDIA A10G") is None, "A10G must not borrow the A10's figure"
    assert "no datasheet peak" in mfu_unknown_note("NVIDIA A10G")
    assert "not in the table" in mfu_unknown_note("Some Future GPU")
    assert mfu_unknown_note("NVIDIA H100 80GB HBM3") is None
    assert peak_flops_for("NVIDIA A10G", peak_tflops=70) == 70e12, "--peak_tflops still gives one"


def test_user_peak_overrides_the_table_and_unknown_devices_get_none():
    assert peak_flops_for("NVIDIA H200", peak_tflops=500) == 500e12
    assert peak_flops_for("Some Future GPU") is None
    assert peak_flops_for(None) is None
    with pytest.raises(ValueError, match="positive"):
        peak_flops_for("NVIDIA H200", peak_tflops=0)


def test_mfu_is_achieved_flop_rate_over_peak():
    assert mfu(2_000, 24.3e9, 312e12) == pytest.approx(2_000 * 24.3e9 / 312e12)
    assert mfu(2_000, 24.3e9, None) is None


@pytest.mark.slow
def test_meta_flop_count_equals_a_real_counted_pass_and_leaves_the_model_untouched():
    from torch.utils.flop_counter import FlopCounterMode

    model = torchvision.models.resnet18(num_classes=10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    counted = count_training_flops(model, 64)["train"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "BN statistics changed"
    assert all(p.grad is None for p in model.parameters())
    assert next(model.parameters()).device.type == "cpu"
    real = copy.deepcopy(model).train()  # the same pass for real, on the CPU, with data
    with FlopCounterMode(display=False) as counter:
        real(torch.randn(2, 3, 64, 64)).sum().backward()
    assert counted == counter.get_total_flops() / 2


@pytest.mark.slow
def test_flops_per_image_scale_with_pixels_and_see_through_compile_wrappers():
    model = torchvision.models.resnet18(num_classes=10)
    f64, f128 = count_training_flops(model, 64)["train"], count_training_flops(model, 128)["train"]
    assert f128 / f64 == pytest.approx(4.0, rel=0.02)
    compiled = torch.compile(model, backend="eager")
    assert count_training_flops(compiled, 64)["train"] == f64


# ---- 2. timing --------------------------------------------------------------------------------


def test_time_windows_runs_warmup_untimed_then_full_windows_and_syncs_each_window():
    calls, syncs = [], []
    secs = time_windows(
        lambda: calls.append(1), windows=3, steps_per_window=4, warmup_steps=5, sync=lambda: syncs.append(len(calls))
    )
    assert len(calls) == 5 + 3 * 4
    assert len(secs) == 3
    assert syncs == [5, 9, 13, 17], "one sync after warm-up and one at the end of every window"
    with pytest.raises(ValueError):
        time_windows(lambda: None, windows=0, steps_per_window=1)


def test_median_throughput_ignores_one_stalled_window():
    assert median_throughput([1.0, 1.0, 10.0, 1.0, 1.0], items_per_window=100) == 100.0


# ---- 3. StepTimer -------------------------------------------------------------------------------


class FakeClock:
    """A stand-in for `time.perf_counter` that only moves when told to: timings without sleeping, exact on a
    loaded machine."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)  # the module every timer here reads
    return fake


class SlowLoader:
    """Yields `n` batches, `delay` seconds of the clock passing before each (a slow input pipeline)."""

    def __init__(self, clock, n, delay, batch=4):
        self.clock, self.n, self.delay, self.batch = clock, n, delay, batch

    def __iter__(self):
        for _ in range(self.n):
            self.clock.advance(self.delay)
            yield torch.zeros(self.batch, 3, 2, 2)


def test_step_timer_bills_loader_waits_to_data_and_step_work_to_compute(clock):
    timer = StepTimer("cpu")
    timer.reset()
    for batch in timer.iterate(SlowLoader(clock, n=5, delay=0.03)):
        clock.advance(0.01)  # the "step"
        timer.step_done(len(batch))
    s = timer.summary()
    assert s["steps"] == 5 and s["images"] == 20
    assert s["data_time"] == pytest.approx(0.15) and s["compute_time"] == pytest.approx(0.05)
    assert s["data_fraction"] == pytest.approx(0.75)
    assert s["images_per_sec"] == pytest.approx(20 / 0.2)


def test_step_timer_reports_mfu_and_progress_bar_strings_and_reset_starts_a_new_epoch(clock):
    timer = StepTimer("cpu", flops_per_image=1e9, peak_flops=1e12)
    for _ in timer.iterate(SlowLoader(clock, n=2, delay=0.0)):
        clock.advance(0.005)
        timer.step_done(4)
    s = timer.summary()
    assert s["images_per_sec"] == pytest.approx(8 / 0.01)
    assert s["mfu"] == pytest.approx(800 * 1e9 / 1e12)
    assert timer.postfix() == {"img/s per process": "800", "data": "0%", "mfu": "80.0%"}
    timer.reset(flops_per_image=2e9)  # e.g. progressive resizing moved to a higher resolution
    assert timer.steps == timer.images == 0 and timer.data_time == timer.compute_time == 0.0
    assert timer.flops_per_image == 2e9
    assert StepTimer("cpu").summary()["mfu"] is None, "no FLOPs given: no MFU guessed"


@pytest.mark.slow
def test_peak_memory_on_cpu_is_the_process_peak_in_bytes():
    """A fresh process touches 1.5 GiB, well above what importing torch peaks at: its peak must grow by
    roughly that many bytes (KiB or pages would give a tiny difference, a wrong factor a huge one)."""
    script = (
        "import torch\n"
        "from tutorial_lib.core import peak_memory_bytes\n"
        "before = peak_memory_bytes('cpu')\n"
        "big = torch.ones(1536 * 2**20 // 4)\n"
        "print(before, peak_memory_bytes('cpu'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    before, after = map(int, out.stdout.split())
    assert 512 * 2**20 < after - before <= 1536 * 2**20 + 64 * 2**20, (before, after)


def test_step_timer_syncs_only_on_cuda_by_default():
    assert StepTimer("cpu").sync is False
    assert StepTimer("cpu", sync=True).sync is True


# ---- 4. loop overhead harness -------------------------------------------------------------------


def test_alternate_flips_the_order_every_round_and_times_each_run():
    order = []
    runs = {"ours": lambda n: order.append(("ours", n)), "bare": lambda n: order.append(("bare", n))}
    times = alternate(runs, rounds=3, steps=7, warmup_rounds=1)
    assert order == [
        ("ours", 7),
        ("bare", 7),  # warm-up
        ("ours", 7),
        ("bare", 7),
        ("bare", 7),
        ("ours", 7),
        ("ours", 7),
        ("bare", 7),
    ]
    assert {k: len(v) for k, v in times.items()} == {"ours": 3, "bare": 3}


def test_overhead_ratio_detects_a_ten_percent_slower_loop(clock):
    runs = {"ours": lambda n: clock.advance(0.011 * n), "bare": lambda n: clock.advance(0.010 * n)}
    assert overhead_ratio(alternate(runs, rounds=5, steps=2)) == pytest.approx(1.1)


def test_paired_ratios_pair_each_round_of_one_loop_with_the_same_round_of_the_other(clock):
    runs = {"ours": lambda n: clock.advance(0.011 * n), "bare": lambda n: clock.advance(0.010 * n)}
    times = alternate(runs, rounds=4, steps=2)
    assert paired_ratios(times) == pytest.approx([1.1] * 4)
    assert paired_ratios({"ours": [2.0, 3.0], "bare": [1.0, 6.0]}) == [2.0, 0.5]


def test_median_interval_uses_order_statistics_and_covers_the_median_at_least_as_often_as_asked():
    import random

    assert median_interval(list(range(16))) == (3, 12)  # P(Binomial(16, 1/2) <= 3) = 0.011 <= 0.025 < P(<= 4)
    assert median_interval([5, 1, 4, 2, 6, 3]) == (1, 6)  # 6 values: only min and max give >= 95 %
    with pytest.raises(ValueError, match="too few"):
        median_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    rng = random.Random(0)
    trials = 2000
    covered = sum(
        lo <= 0.0 <= hi for lo, hi in (median_interval([rng.gauss(0, 1) for _ in range(40)]) for _ in range(trials))
    )
    assert covered / trials >= 0.94  # its exact coverage for 40 values is 96.2 %


@pytest.mark.slow
def test_bare_step_is_a_real_training_loop():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    w0 = model.fc.weight.detach().clone()
    with torch.no_grad():
        loss_before = torch.nn.functional.cross_entropy(model(x), y).item()
    make_bare_step(model, x, y, lr=0.05)(4)
    assert not torch.equal(w0, model.fc.weight), "SGD must update the weights"
    assert all(p.grad is None for p in model.parameters()), "gradients are cleared after each step"
    with torch.no_grad():
        assert torch.nn.functional.cross_entropy(model(x), y).item() < loss_before, "the loss on the batch must fall"


@pytest.mark.slow
def test_loop_benchmark_a_a_test_reports_medians_and_ratio():
    r = run_loop_benchmark(arch="resnet18", img_size=32, batch_size=4, steps=1, rounds=3, ours="bare")
    assert len(r["ours_round_s"]) == len(r["bare_round_s"]) == 3
    assert r["overhead_ratio"] == pytest.approx(
        statistics.median(r["ours_round_s"]) / statistics.median(r["bare_round_s"])
    )
    with pytest.raises(ValueError, match="ours"):
        run_loop_benchmark(ours="something")


@pytest.mark.slow
def test_our_step_runs_the_training_scripts_epoch_with_its_scheduler_and_clipping():
    from tutorial_lib.bench import make_our_step

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    w0 = model.fc.weight.detach().clone()
    shapes = []
    model.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    run = make_our_step(model, x, y, steps=3, num_classes=5, lr=0.05, max_grad_norm=1e-3)
    run(3)
    run(3)
    assert shapes == [(4, 3, 32, 32)] * 6, "the training step sees the batch as it is (no resize, same size)"
    moved = (model.fc.weight - w0).norm().item()
    assert moved > 0, "train_one_epoch must update the weights"
    # clipping to a norm of 1e-3 bounds every step: 6 SGD steps with momentum move fc by less than
    # 6 * 0.05 * 1e-3 * (1/(1-0.9))
    assert moved < 6 * 0.05 * 1e-3 * 10
    with pytest.raises(ValueError, match="built for epochs of 3 steps"):
        run(2)


@pytest.mark.slow
def test_bench_loop_cli_compares_the_training_step_and_ends_with_json():
    out = (
        run_module("loop", "--img_size", "32", "--batch_size", "4", "--steps", "1", "--rounds", "2")
        .stdout.strip()
        .splitlines()
    )
    last = json.loads(out[-1])
    assert last["ours"] == "train" and last["overhead_ratio"] > 0
    assert any(line.startswith("overhead_ratio") for line in out)
    aa = json.loads(
        run_module("loop", "--ours", "bare", "--img_size", "32", "--batch_size", "4", "--steps", "1", "--rounds", "2")
        .stdout.strip()
        .splitlines()[-1]
    )
    assert aa["ours"] == "bare"


# ---- 5. bench gpu ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_gpu_without_cuda_prints_one_skip_line_and_exits_zero():
    proc = run_module("gpu", env_extra={"CUDA_VISIBLE_DEVICES": ""}, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench gpu skipped:"), proc.stdout
    assert "Traceback" not in proc.stderr


def test_synthetic_run_uses_the_requested_memory_format_and_trains():
    run = build_synthetic_run(
        "resnet18", "channels_last", "cpu", batch_size=2, img_size=32, num_classes=10, amp_dtype=None
    )
    assert run["images"].is_contiguous(memory_format=torch.channels_last)
    assert run["model"].conv1.weight.is_contiguous(memory_format=torch.channels_last)
    w0 = run["model"].fc.weight.detach().clone()
    loss = run["step"](run["images"], run["labels"])
    assert torch.isfinite(loss) and not torch.equal(w0, run["model"].fc.weight)
    with pytest.raises(ValueError, match="unknown config"):
        build_synthetic_run("resnet18", "fp8_magic", "cpu", 2, 32)


def test_measure_steps_counts_images_per_second_from_the_median_window(clock):
    row = measure_steps(
        lambda: clock.advance(0.01), torch.device("cpu"), batch_size=8, windows=3, steps_per_window=2, warmup_steps=1
    )
    assert len(row["window_s"]) == 3
    assert row["images_per_sec"] == pytest.approx(8 * 2 / statistics.median(row["window_s"]))
    assert row["images_per_sec"] == pytest.approx(800)  # 8 images per 10 ms step


def test_jpeg_listing_labels_flat_folders_by_name_prefix(jpeg_folder):
    files, labels, classes = jpeg_files_and_labels(jpeg_folder)
    assert len(files) == 6 and classes == ["n00", "n01", "n02"]
    assert [classes[y] for y in labels] == [f.name.split("_")[0] for f in files]
    with pytest.raises(FileNotFoundError, match="--data_dir"):
        jpeg_files_and_labels(jpeg_folder / "missing")


def test_jpeg_listing_is_the_data_modules_listing_of_jpegs(jpeg_folder, tmp_path):
    from tutorial_lib.core import MissingPathError
    from tutorial_lib.sources import list_images

    folder = tmp_path / "classes"
    for name in ("n01", "n02"):
        shutil.copytree(jpeg_folder, folder / name)
    (folder / "n01" / "._n00_thing0.JPEG").write_bytes(b"\0\5\26\7")  # what macOS leaves: not a JPEG
    (folder / "n02" / "moved.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (folder / "n03").mkdir()  # an empty class folder is no class
    (folder / "n02" / "x.png").write_bytes((jpeg_folder / "n00_thing0.JPEG").read_bytes())
    files, labels, classes = jpeg_files_and_labels(folder)
    assert [str(f) for f in files] == list_images(folder, (".jpg", ".jpeg")) and len(files) == 12
    assert classes == ["n01", "n02"] and labels == [0] * 6 + [1] * 6
    with pytest.raises(MissingPathError, match="--data_dir"):
        jpeg_files_and_labels(folder / "missing")


def test_linked_folder_gives_a_flat_folder_the_imagefolder_layout(jpeg_folder, tmp_path):
    from tutorial_lib.loading import build_datasets

    root = linked_image_folder(jpeg_folder, tmp_path / "linked")
    train_ds, val_ds = build_datasets(root, img_size=16)
    assert train_ds.classes == val_ds.classes == ["n00", "n01", "n02"]
    assert len(train_ds) == 6 and len(val_ds) == 3, "every file for training, one per class for validation"
    capped = linked_image_folder(jpeg_folder, tmp_path / "capped", max_files=3)
    assert len(list((capped / "train").rglob("*.JPEG"))) == 3
    repeated = RepeatDataset(train_ds, length=10)
    assert len(repeated) == 10 and repeated.classes == train_ds.classes, "attributes come from the wrapped dataset"


@pytest.mark.parametrize("pipeline", ["fast", "gpu"])
def test_jpeg_feeds_yield_normalized_batches_in_the_model_memory_format(jpeg_folder, pipeline):
    feed = jpeg_batches(
        jpeg_folder,
        pipeline,
        length=12,
        batch_size=4,
        img_size=24,
        workers=0,
        device="cpu",
        memory_format=torch.channels_last,
        num_classes=2,
    )
    batches = list(feed)
    assert len(batches) == 3, "length 12 / batch 4 (drop_last)"
    for x, y in batches:
        assert x.shape == (4, 3, 24, 24) and x.dtype == torch.float32
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert x.std() > 0.2, "real, normalized pixels"
        assert y.dtype == torch.int64 and set(y.tolist()) <= {0, 1}, "labels folded into num_classes"
    with pytest.raises(ValueError, match="pipeline"):
        next(jpeg_batches(jpeg_folder, "dali", 4, 2, 24, 0, "cpu"))


@pytest.mark.slow
def test_gpu_benchmark_end_to_end_rows_run_on_cpu(jpeg_folder):
    result = run_gpu_benchmark(
        "cpu",
        **DRY_RUN,
        configs=["eager_nchw"],
        compile_backend="eager",
        data_dir=jpeg_folder,
        workers=1,
        decode_workers=0,
        log=lambda s: None,
    )
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"eager_nchw", "eager_nchw+cpu_workers", "eager_nchw+device_decode"}
    assert all(r["images_per_sec"] > 0 for r in rows.values()), rows
    assert result["e2e_over_synthetic"] == pytest.approx(result["best_e2e_ips"] / result["best_synthetic_ips"])


@pytest.mark.slow
def test_gpu_benchmark_code_path_runs_on_cpu_synthetic_rows():
    result = run_gpu_benchmark(
        "cpu", **DRY_RUN, compile_backend="eager", data_dir=None, peak_tflops=1.0, log=lambda s: None
    )
    rows = result["rows"]
    assert [r["config"] for r in rows] == ["eager_nchw", "channels_last", "channels_last_compile"]
    for r in rows:
        assert r["images_per_sec"] > 0 and len(r["window_s"]) == DRY_RUN["windows"]
        assert r["mfu"] == pytest.approx(r["images_per_sec"] * result["train_flops_per_image"] / 1e12)
    assert result["best_synthetic_ips"] == max(r["images_per_sec"] for r in rows)
    assert "eager_nchw" in format_gpu_table(result)


@pytest.mark.slow
def test_gpu_benchmark_budget_skips_what_it_cannot_start():
    result = run_gpu_benchmark(
        "cpu", **DRY_RUN, compile_backend="eager", data_dir=None, budget_s=0.0, log=lambda s: None
    )
    assert all(r.get("skipped") == "time budget" for r in result["rows"])
    assert "skipped" in format_gpu_table(result)


@pytest.mark.slow
def test_bench_data_delegates_to_07_and_ends_with_a_json_line(jpeg_folder):
    out = run_module("data", "--data_dir", str(jpeg_folder), "--workers", "0").stdout.strip().splitlines()
    last = json.loads(out[-1])
    assert {"baseline_train_ips", "ours_train_ips", "baseline_val_ips", "ours_val_ips"} <= set(last)
    assert any(line.startswith("train") for line in out) and any(line.startswith("val") for line in out)


# ---- 6. helpers of the fast-recipe switches ---------------------------------------------------------


def test_progressive_resolution_follows_ffcvs_schedule():
    from tutorial_lib.transforms import progressive_resolution

    schedule = [progressive_resolution(e, 160, 192, end_ramp=76, start_ramp=65) for e in range(88)]
    assert schedule[:66] == [160] * 66 and schedule[76:] == [192] * 12
    assert all(a <= b for a, b in zip(schedule, schedule[1:])) and set(schedule) == {160, 192}
    ramp = [progressive_resolution(e, 16, 48, end_ramp=4, step=8) for e in range(6)]
    assert ramp == [16, 24, 32, 40, 48, 48]
    assert progressive_resolution(3, 20, 30, end_ramp=4, step=32) in range(20, 31), "clamped to [min_res, max_res]"
    with pytest.raises(ValueError, match="min_res"):
        progressive_resolution(0, 64, 32, end_ramp=3)
    with pytest.raises(ValueError, match="start_ramp"):
        progressive_resolution(0, 32, 64, end_ramp=1, start_ramp=2)


def test_resize_batch_changes_the_size_keeps_the_layout_and_skips_same_size():
    from tutorial_lib.transforms import resize_batch

    x = torch.rand(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    y = resize_batch(x, 16)
    assert y.shape == (2, 3, 16, 16) and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(y.mean(), x.mean(), atol=0.02), "an antialiased resize keeps the mean brightness"
    assert resize_batch(x, 32) is x
    assert resize_batch(torch.rand(2, 3, 8, 8), 4).is_contiguous()


def test_make_ema_averages_weights_and_batchnorm_buffers_and_sees_through_compile():
    from tutorial_lib.optim import make_ema

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.LazyLinear(2)
    )
    x, y = 2 + torch.randn(8, 3, 6, 6), torch.randint(0, 2, (8,))
    net(x)  # materialise the lazy layer
    ema = make_ema(torch.compile(net, backend="eager"), decay=0.5)
    assert type(ema.module) is torch.nn.Sequential, "the EMA holds the plain module"
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    expected = None
    for _ in range(3):
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(net)
        w = net[0].weight.detach().clone()
        expected = w if expected is None else 0.5 * expected + 0.5 * w
    assert torch.allclose(ema.module[0].weight, expected, atol=1e-6)
    assert not torch.allclose(ema.module[1].running_mean, net[1].running_mean), "buffers are averaged, not copied"
    with pytest.raises(ValueError, match="decay"):
        make_ema(net, decay=1.0)


def test_model_ema_matches_pytorchs_averaged_model_and_keeps_its_counter_on_the_cpu():
    """ModelEMA (no host sync per update) computes what AveragedModel + get_ema_multi_avg_fn computes,
    and a loaded EMA continues averaging instead of copying the weights again."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from tutorial_lib.optim import ModelEMA, make_ema

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(64, 2)
    )
    x, y = 2 + torch.randn(8, 3, 6, 6), torch.randint(0, 2, (8,))
    ours = make_ema(net, decay=0.7)
    reference = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.7), use_buffers=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    for _ in range(4):
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        ours.update_parameters(net)
        reference.update_parameters(net)
    assert isinstance(ours, ModelEMA) and isinstance(ours, AveragedModel)
    for (name, a), b in zip(ours.module.state_dict().items(), reference.module.state_dict().values()):
        if a.is_floating_point():
            assert torch.allclose(a, b, atol=1e-6), name
    assert ours.module[1].num_batches_tracked == net[1].num_batches_tracked == 4, "integer counters are the model's"
    assert int(ours.n_averaged) == 4 and ours.n_averaged.device.type == "cpu"

    resumed = make_ema(
        torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(64, 2)
        ),
        decay=0.7,
    )
    resumed.load_state_dict(ours.state_dict())
    before = resumed.module[0].weight.clone()
    resumed.update_parameters(net)
    ours.update_parameters(net)
    assert int(resumed.n_averaged) == 5 and torch.allclose(resumed.module[0].weight, ours.module[0].weight)
    assert not torch.allclose(resumed.module[0].weight, net[0].weight), "a resumed EMA averages, it does not copy"
    assert torch.allclose(resumed.module[0].weight, 0.7 * before + 0.3 * net[0].weight, atol=1e-6)


# ---- 7. the command lines of bench and stress: one convention, help with defaults, fast help ----------------


def flag_helps(help_text: str) -> dict[str, str]:
    """`--flag` -> its help text, read from argparse's `--help` output (one entry per option, wrapped lines joined)."""
    helps, flag = {}, None
    for line in help_text.split("options:", 1)[1].splitlines():
        stripped = line.strip()
        if line.startswith("  -"):
            flag = stripped.split()[0].rstrip(",")
            helps[flag] = stripped.split("  ", 1)[1].strip() if "  " in stripped else ""
        elif flag and stripped:
            helps[flag] += " " + stripped
    return helps


def subcommand_parsers(parser):
    import argparse

    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_bench_and_stress_flags_use_underscores_and_show_every_default():
    from tutorial_lib.bench import get_args_parser as bench_parser
    from tutorial_lib.databench import get_args_parser as data_parser
    from tutorial_lib.stress import get_args_parser as stress_parser

    checked = 0
    for parser in (bench_parser(), stress_parser()):
        commands = {**subcommand_parsers(parser), **({"data": data_parser()} if parser.prog.endswith("bench") else {})}
        for name, sub in commands.items():  # bench data: databench's parser, under the name bench data
            helps = flag_helps(sub.format_help())
            flags = [s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
            assert set(flags) <= set(helps), (name, set(flags) - set(helps))
            for flag in flags:
                assert "-" not in flag[2:], f"{sub.prog} {flag}: flags are spelled with underscores, as --batch_size"
                assert "(default: " in helps[flag] or helps[flag].endswith("required"), (
                    f"{sub.prog} {flag}: {helps[flag]!r}"
                )
                assert helps[flag].count("(default") <= 1, f"{sub.prog} {flag} shows its default twice: {helps[flag]!r}"
                checked += 1
    assert checked >= 30, checked


@pytest.mark.parametrize(
    "argv, message",
    [
        (["loop", "--batch_size", "0"], "python -m tutorial_lib.bench loop: error: --batch_size must be >= 1, got 0"),
        (
            ["loop", "--momentum", "1"],
            "python -m tutorial_lib.bench loop: error: --momentum must be in [0, 1), got 1.0",
        ),
        (
            ["gpu", "--peak_tflops", "-5"],
            "python -m tutorial_lib.bench gpu: error: --peak_tflops must be a positive number, got -5.0",
        ),
        (
            ["gpu", "--device", "gpu0"],
            "python -m tutorial_lib.bench gpu: error: --device must be a torch device such as "
            "cuda, cuda:1 or cpu, got 'gpu0'",
        ),
        (["loop", "--batch-size", "4"], "python -m tutorial_lib.bench: error: unrecognized arguments: --batch-size 4"),
        (["loop", "--batch", "4"], "python -m tutorial_lib.bench: error: unrecognized arguments: --batch 4"),
        (["data"], "python -m tutorial_lib.bench data: error: the following arguments are required: --data_dir"),
        (
            ["loop", "--rounds", "3"],
            "python -m tutorial_lib.bench loop: error: --rounds must be even (each loop goes first in half of the "
            "rounds), got 3",
        ),
        (["loop", "--rounds", "0"], "python -m tutorial_lib.bench loop: error: --rounds must be >= 2, got 0"),
    ],
)
def test_bench_refuses_bad_values_in_one_line_with_exit_2(argv, message, capsys):
    from tutorial_lib.bench import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [message], "one line, no usage block"


def test_bench_data_is_the_databench_command_under_another_name(monkeypatch, capsys):
    import tutorial_lib.bench as bench
    import tutorial_lib.databench as databench

    seen = []
    monkeypatch.setattr(databench, "run_data_benchmark", lambda data_dir, **kw: seen.append((data_dir, kw)) or {})
    monkeypatch.setattr(databench, "print_data_benchmark", lambda result: print("the table"))
    monkeypatch.setenv("HOME", "/home/me")
    argv = ["--data_dir", "~/photos", "--workers", "0", "--img_size", "64", "--max_images", "10", "--no_parquet"]
    bench.main(["data", *argv])
    databench.main(argv)
    assert seen[0] == seen[1] and seen[0][0] == "/home/me/photos", seen
    assert seen[0][1]["img_size"] == 64 and seen[0][1]["max_images"] == 10 and seen[0][1]["parquet"] is False
    assert capsys.readouterr().out == "the table\n" * 2
    helps = []
    for main, args in ((bench.main, ["data", "--help"]), (databench.main, ["--help"])):
        with pytest.raises(SystemExit):
            main(args)
        helps.append(capsys.readouterr().out)
    assert helps[0].startswith("usage: python -m tutorial_lib.bench data ")
    assert helps[0].split("\n\n", 1)[1] == helps[1].split("\n\n", 1)[1], "the same description and flags"


def test_bench_data_refuses_a_file_given_as_data_dir_in_one_line_before_reading_it(tmp_path, capsys, monkeypatch):
    import tutorial_lib.databench as databench
    from tutorial_lib.bench import main

    (tmp_path / "photos.zip").write_bytes(b"PK")
    monkeypatch.setattr(databench, "DataLoader", lambda *a, **kw: pytest.fail("data was read"))
    with pytest.raises(SystemExit) as exit_:
        main(["data", "--data_dir", str(tmp_path / "photos.zip")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"python -m tutorial_lib.bench data: error: image folder {tmp_path / 'photos.zip'} is a file, not a folder: "
        "check the path"
    ]


def test_bench_gpu_applies_dry_run_sizes_only_where_no_flag_was_given(monkeypatch, capsys):
    import tutorial_lib.bench as bench

    seen = {}
    monkeypatch.setattr(bench, "run_gpu_benchmark", lambda device, **kw: seen.update(kw) or {"rows": []})
    monkeypatch.setattr(bench, "format_gpu_table", lambda result: "")
    bench.main(["gpu", "--device", "cpu", "--dry_run", "--batch_size", "2", "--no_e2e"])
    assert {k: seen[k] for k in ("arch", "img_size", "batch_size", "windows")} == {
        "arch": "resnet18",
        "img_size": 64,
        "batch_size": 2,
        "windows": 2,
    }
    assert seen["data_dir"] is None and seen["compile_backend"] == "eager" and seen["workers"] is None
    assert seen["peak_tflops"] is None and seen["budget_s"] == 480.0


def import_times(*args: str) -> tuple[float, float, set[str]]:
    """Run `python -X importtime ARGS`: the seconds all its imports took, those of them that torch took, and the
    names of every module imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    total, torch_seconds, names = 0.0, 0.0, set()
    for line in done.stderr.splitlines():
        if "|" not in line or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|")
        names.add(name.strip())
        if not name.startswith("   "):  # a top-level import: its cumulative time includes everything it imported
            total += int(cumulative) / 1e6
        if name.strip() == "torch" and not torch_seconds:
            torch_seconds = int(cumulative) / 1e6
    return total, torch_seconds, names


@pytest.mark.slow
def test_help_of_bench_and_stress_costs_about_an_import_of_torch():
    """`--help` imports what the parser needs (torch, through 00) and nothing heavier. Both figures come from one
    process (`-X importtime`), so a busy machine slows them alike: everything but torch must cost under 30 % of
    torch's own import (about 8 % today; torchvision alone adds more than torch itself), and none of the heavy
    modules the commands use may be imported at all."""
    heavy = {
        "torchvision",
        "accelerate",
        "torchmetrics",
        "tutorial_lib.train",
        "tutorial_lib.data",
        "datasets",
        "wandb",
    }
    for argv in (["-m", "tutorial_lib.bench", "--help"], ["-m", "tutorial_lib.stress", "resume", "--help"]):
        total, torch_seconds, imported = import_times(*argv)
        assert torch_seconds > 0, f"{argv} --help should import torch (the parser's types come from 00)"
        assert total - torch_seconds < 0.3 * torch_seconds, (
            f"{argv}: {total - torch_seconds:.2f} s of imports besides torch's {torch_seconds:.2f} s"
        )
        assert not heavy & imported, f"{argv} imported {sorted(heavy & imported)}"
