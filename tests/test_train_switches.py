"""The training script's fast-recipe switches and step-time accounting (issue 6; the switches are flags
of notebook 08a, used by the training script of notebook 08b, and measured in notebook 10).

Each switch is off by default, runs on CPU, and changes what it should; every epoch's row in
metrics.jsonl carries the StepTimer numbers."""

import json

import pytest
import torch

from tutorial_lib import accel, flags
from tutorial_lib import train as T
from tutorial_lib.accel import read_metrics
from tutorial_lib.checkpoints import latest_checkpoint
from tutorial_lib.core import count_training_flops
from tutorial_lib.transforms import progressive_resolution

# a test that starts processes or trains is marked slow (skipped by `pytest -m "not slow"`): the conftest checks it

BASE = dict(
    model="tinycnn",
    img_size=16,
    epochs=2,
    batch_size=16,
    num_workers=0,
    cpu=True,
    log_with="none",
    disable_progress_bar=True,
    max_train_samples=64,
    max_val_samples=32,
    learning_rate=0.05,
    lr_scheduler="constant",
)


def run(tmp_path, name, **options):
    """Train a tiny model on the embedded data; return the final metrics and the metrics.jsonl rows."""
    final = T.train(flags.default_args(**{**BASE, **options}, working_directory=str(tmp_path), experiment_name=name))
    return final, read_metrics(tmp_path / name / "metrics.jsonl")


@pytest.fixture
def spy(monkeypatch):
    """The model train() builds, and (training?, H×W, channels_last?) of every forward pass of that model."""
    seen = {"model": None, "calls": []}
    build = flags.build_model

    def build_and_watch(name, num_classes, *options):
        model = build(name, num_classes, *options)

        def hook(module, args):
            x = args[0]
            if module is seen["model"] and x.device.type != "meta":  # not the EMA's copy, nor check_args' shape probe
                seen["calls"].append(
                    (
                        module.training,
                        tuple(x.shape[-2:]),
                        x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous(),
                    )
                )

        model.register_forward_pre_hook(hook)
        seen["model"] = model
        return model

    monkeypatch.setattr(T, "build_model", build_and_watch)
    return seen


@pytest.mark.slow
def test_every_switch_is_off_by_default_and_a_default_run_logs_step_time_accounting(tmp_path, spy):
    args = flags.default_args()
    assert not (args.channels_last or args.compile or args.ema) and args.label_smoothing == 0.0
    assert args.min_res is None and args.max_res is None and args.val_img_size is None
    _, rows = run(tmp_path, "plain")
    assert [r["train_res"] for r in rows] == [16, 16]
    assert {shape for _, shape, _ in spy["calls"]} == {(16, 16)} and not any(cl for *_, cl in spy["calls"])
    for r in rows:
        assert not any(k.startswith("ema_") for k in r)
        assert r["data_time"] >= 0 and r["compute_time"] > 0 and 0 <= r["data_fraction"] <= 1
        assert r["peak_memory_mb"] > 0
        assert "mfu" not in r, "no MFU on a CPU without --peak_tflops"


@pytest.mark.slow
def test_mfu_is_images_per_second_times_flops_at_the_resolution_over_the_peak(tmp_path):
    _, rows = run(tmp_path, "mfu", peak_tflops=0.01)
    flops = count_training_flops(flags.build_model("tinycnn", 10), 16)["train"]
    for r in rows:
        per_process_ips = r["train_count"] / (r["data_time"] + r["compute_time"])
        assert r["mfu"] == pytest.approx(per_process_ips * flops / 0.01e12, rel=1e-6)


@pytest.mark.slow
def test_channels_last_makes_weights_and_every_batch_nhwc_without_changing_results(tmp_path, spy):
    _, plain = run(tmp_path, "plain")
    spy["calls"].clear()
    _, rows = run(tmp_path, "nhwc", channels_last=True)
    assert spy["model"][0].weight.is_contiguous(memory_format=torch.channels_last)
    assert spy["calls"] and all(cl for *_, cl in spy["calls"]), "train and val batches arrive channels_last"
    for a, b in zip(plain, rows, strict=True):
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-4), "the same maths in another layout"


@pytest.mark.slow
def test_compile_trains_through_torch_compile_and_checkpoints_the_plain_weights(tmp_path, monkeypatch):
    _, plain = run(tmp_path, "plain")
    compiled = []
    real_compile = torch.compile

    def recording_compile(model, **kwargs):
        compiled.append(kwargs.get("backend"))
        return real_compile(model, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    _, rows = run(tmp_path, "compiled", compile=True, compile_backend="aot_eager")
    assert compiled == ["aot_eager"], "one torch.compile call, with the chosen backend"
    for a, b in zip(plain, rows, strict=True):
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-4)
    from safetensors.torch import load_file

    assert (
        load_file(tmp_path / "compiled" / "model.safetensors").keys()
        == load_file(tmp_path / "plain" / "model.safetensors").keys()
    ), "no _orig_mod. prefix in saved weights"


@pytest.mark.slow
def test_label_smoothing_changes_the_training_and_validation_loss(tmp_path):
    _, plain = run(tmp_path, "plain", epochs=1)
    _, smooth = run(tmp_path, "smooth", epochs=1, label_smoothing=0.1)
    assert smooth[0]["train_loss"] != pytest.approx(plain[0]["train_loss"], rel=1e-4)
    assert smooth[0]["val_loss"] != pytest.approx(plain[0]["val_loss"], rel=1e-4)
    assert json.loads((tmp_path / "smooth" / "config.json").read_text())["label_smoothing"] == 0.1


@pytest.mark.slow
def test_ema_is_evaluated_alongside_differs_from_the_raw_weights_and_resumes_exactly(tmp_path):
    options = dict(ema=True, ema_decay=0.7, epochs=2)
    _, straight = run(tmp_path, "straight", **options)
    for r in straight:
        assert {"ema_val_loss", "ema_val_top1", "ema_val_top5"} <= r.keys()
        assert r["ema_val_loss"] != pytest.approx(r["val_loss"], rel=1e-6), "the average is another model"
    checkpoint = latest_checkpoint(tmp_path / "straight")
    assert (checkpoint / "custom_checkpoint_0.pkl").is_file(), "the EMA is part of every checkpoint"
    stopped, _ = run(tmp_path, "resumed", **options, stop_after_steps=6)  # mid-way through epoch 1
    assert stopped["stopped"]
    _, resumed = run(tmp_path, "resumed", **options, resume_from_checkpoint="latest")
    for key in ["ema_val_loss", "ema_val_top1", "val_loss"]:
        assert resumed[-1][key] == pytest.approx(straight[-1][key], rel=1e-6), key


@pytest.mark.slow
def test_progressive_resizing_trains_at_the_schedule_and_evaluates_at_val_img_size(tmp_path, spy):
    schedule = dict(min_res=8, max_res=16, end_ramp=2, res_step=4)
    _, rows = run(tmp_path, "progressive", epochs=3, val_img_size=24, peak_tflops=0.01, **schedule)
    expected = [progressive_resolution(e, 8, 16, end_ramp=2, step=4) for e in range(3)]
    assert expected == [8, 12, 16] and [r["train_res"] for r in rows] == expected
    train_sizes = [shape for training, shape, _ in spy["calls"] if training]
    assert train_sizes == [(r, r) for r in expected for _ in range(4)], "4 batches per epoch at the epoch's size"
    assert {shape for training, shape, _ in spy["calls"] if not training} == {(24, 24)}
    # cheaper epochs at lower resolution: MFU is counted with the FLOPs of the resolution trained at
    flops = {r: count_training_flops(spy["model"], r)["train"] for r in expected}
    for r in rows:
        ips = r["train_count"] / (r["data_time"] + r["compute_time"])
        assert r["mfu"] == pytest.approx(ips * flops[r["train_res"]] / 0.01e12, rel=1e-6)


@pytest.mark.parametrize(
    "options, flag",
    [
        (dict(min_res=8), "--min_res"),
        (dict(min_res=32, max_res=16, end_ramp=1), "--min_res"),
        (dict(ema_decay=1.0), "--ema_decay"),
        (dict(val_img_size=0), "--val_img_size"),
        (dict(peak_tflops=-1.0), "--peak_tflops"),
    ],
)
def test_impossible_switch_values_are_refused_naming_the_flag(tmp_path, options, flag):
    with pytest.raises(flags.BadFlagError, match=flag):
        run(tmp_path, "bad", **options)


def test_batches_are_copied_without_waiting_on_cuda_only(monkeypatch):
    """Non-blocking host-to-device copies overlap the previous step on CUDA; on MPS they have corrupted
    data and on a CPU there is nothing to copy, so they are used on CUDA only."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert accel.overlapping_copies(cpu=False) is True
    assert accel.overlapping_copies(cpu=True) is False, "--cpu on a GPU machine"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert accel.overlapping_copies(cpu=False) is False, "Apple MPS or CPU"


@pytest.mark.slow
def test_training_asks_accelerate_for_overlapping_copies(tmp_path, monkeypatch):
    """train() passes `overlapping_copies` to Accelerate's loader configuration: a blocking copy would
    wait for the previous step to finish at every batch."""
    import accelerate

    configs = []
    build = accelerate.Accelerator.__init__

    def recording_init(self, *args, **kwargs):
        configs.append(kwargs.get("dataloader_config"))
        build(self, *args, **kwargs)

    monkeypatch.setattr(accelerate.Accelerator, "__init__", recording_init)
    monkeypatch.setattr(accel, "overlapping_copies", lambda cpu=False: "asked")  # train() must use its answer
    run(tmp_path, "nonblocking", epochs=1)
    assert len(configs) == 1 and configs[0] is not None and configs[0].non_blocking == "asked"
