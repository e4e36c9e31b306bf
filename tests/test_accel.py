"""tutorial_lib.accel: printing/logging once, exact metrics across processes.

The distributed tests run 2 real CPU processes (gloo) with `accelerate.debug_launcher`; the launched
functions live at module level so they can be pickled. debug_launcher rendezvous through a temp
file, so parallel test runs do not compete for a port.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tutorial_lib.accel import ClassificationMetrics, MetricsLogger, read_metrics
from tutorial_lib.core import fork_safe

NUM_CLASSES = 10
N_SAMPLES = 37  # does not divide by num_processes (2) x batch_size (4)
BATCH_SIZE = 4


def make_logits_dataset(n: int = N_SAMPLES, num_classes: int = NUM_CLASSES) -> TensorDataset:
    """Fixed 'predictions' and labels: the first samples are classified right, the last ones wrong.

    The dataset's start is what `even_batches` pads the last batch with, so counting padding (or
    averaging per-process means) visibly moves the accuracy."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    logits = torch.randn(n, num_classes, generator=g)
    right = torch.arange(n) < n // 3
    logits[right, labels[right]] += 10.0  # confidently right
    logits[~right, labels[~right]] -= 10.0  # confidently wrong (outside the top 5)
    return TensorDataset(logits, labels)


def reference_metrics(ds: TensorDataset) -> dict:
    """Top-1/top-5/loss over the whole dataset in one process, computed directly."""
    logits, labels = ds.tensors
    top5 = logits.topk(5, dim=1).indices
    return {
        "top1": 100 * (top5[:, 0] == labels).double().mean().item(),
        "top5": 100 * (top5 == labels[:, None]).any(1).double().mean().item(),
        "loss": torch.nn.functional.cross_entropy(logits, labels).item(),
        "count": len(labels),
    }


# --------------------------------------------------------------------------- unit tests


def test_metrics_logger_appends_one_json_line_per_call_with_tensors_as_numbers(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"  # parent folder does not exist yet
    logger = MetricsLogger(path, accelerator=SimpleNamespace(is_main_process=True))
    logger.log({"epoch": 0, "val_top1": torch.tensor(12.5), "lr": torch.tensor([0.1])[0]})
    logger.log({"epoch": 1, "val_top1": 30.0})
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0]) == {"epoch": 0, "val_top1": 12.5, "lr": pytest.approx(0.1)}
    assert read_metrics(path)[1] == {"epoch": 1, "val_top1": 30.0} == logger.read()[1]


def test_metrics_logger_writes_nothing_off_the_main_process(tmp_path):
    path = tmp_path / "metrics.jsonl"
    MetricsLogger(path, accelerator=SimpleNamespace(is_main_process=False)).log({"epoch": 0})
    assert not path.exists() and read_metrics(path) == []


def test_metrics_logger_refuses_non_scalar_tensors_with_a_hint(tmp_path):
    with pytest.raises(TypeError, match="scalars"):
        MetricsLogger(tmp_path / "m.jsonl").log({"loss": torch.ones(3)})


def test_classification_metrics_match_a_direct_computation_over_several_batches():
    ds = make_logits_dataset()
    logits, labels = ds.tensors
    per_sample = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    metrics = ClassificationMetrics(NUM_CLASSES)
    for start in range(0, N_SAMPLES, 8):
        sl = slice(start, start + 8)
        metrics.update(logits[sl], labels[sl], per_sample[sl])
    result, expected = metrics.compute(), reference_metrics(ds)
    assert result["count"] == N_SAMPLES
    for key in ["top1", "top5", "loss"]:
        assert result[key] == pytest.approx(expected[key], abs=1e-4), key


def test_classification_metrics_scalar_loss_counts_as_the_batch_mean():
    logits, labels = torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    metrics = ClassificationMetrics(3)
    metrics.update(logits[:2], labels[:2], torch.tensor(1.0))
    metrics.update(logits[2:], labels[2:], 4.0)
    out = metrics.compute()
    assert out["loss"] == pytest.approx((2 * 1.0 + 4 * 4.0) / 6)
    assert out["top5"] == 100.0, "with 3 classes every label is within the top 5"


def test_classification_metrics_reset_forgets_everything():
    metrics = ClassificationMetrics(NUM_CLASSES)
    metrics.update(torch.randn(4, NUM_CLASSES), torch.arange(4), torch.zeros(4))
    metrics.reset()
    out = metrics.compute()
    assert out["count"] == 0 and math.isnan(out["top1"])


def test_classification_metrics_refuse_mismatched_shapes():
    metrics = ClassificationMetrics(NUM_CLASSES)
    with pytest.raises(ValueError, match="logits"):
        metrics.update(torch.randn(4, 7), torch.arange(4))
    with pytest.raises(ValueError, match="labels"):
        metrics.update(torch.randn(4, NUM_CLASSES), torch.arange(3))
    with pytest.raises(ValueError, match="num_classes"):
        ClassificationMetrics(1)


def test_gather_update_refuses_uneven_batches_with_a_hint():
    metrics = ClassificationMetrics(NUM_CLASSES)
    with pytest.raises(ValueError, match="sync_on_compute=True"):
        metrics.gather_update(SimpleNamespace(even_batches=False), torch.randn(2, NUM_CLASSES), torch.arange(2))


# --------------------------------------------------------------------------- 2 real processes


def _two_process_metrics(out_dir: str) -> None:
    """Launched on each of 2 CPU processes: evaluate the fixed dataset three ways and record it."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    ds = make_logits_dataset()
    loader = accelerator.prepare(DataLoader(ds, batch_size=BATCH_SIZE, shuffle=False))

    exact = ClassificationMetrics(NUM_CLASSES)  # gather_for_metrics, then count
    local = ClassificationMetrics(NUM_CLASSES)  # this process's samples only
    for logits, labels in loader:
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        exact.gather_update(accelerator, logits, labels, loss)
        local.update(logits, labels, loss)
    local_result = local.compute()

    # sync_on_compute=True: update with local tensors, compute() adds the sums over the processes (all_reduce).
    synced_padded = ClassificationMetrics(NUM_CLASSES, sync_on_compute=True)
    for logits, labels in loader:  # default even_batches: padded
        synced_padded.update(logits, labels, torch.nn.functional.cross_entropy(logits, labels, reduction="none"))
    accelerator.even_batches = False  # uneven last batch, no padding
    uneven_loader = accelerator.prepare(DataLoader(ds, batch_size=BATCH_SIZE, shuffle=False))
    synced_uneven = ClassificationMetrics(NUM_CLASSES, sync_on_compute=True)
    for logits, labels in uneven_loader:
        synced_uneven.update(logits, labels, torch.nn.functional.cross_entropy(logits, labels, reduction="none"))
    # The pitfall: gather each process's accuracy and average those scalars.
    per_process_top1 = accelerator.gather(torch.tensor([local_result["top1"]], dtype=torch.float64))

    MetricsLogger(Path(out_dir) / "metrics.jsonl", accelerator).log({"rank": accelerator.process_index})

    record = {
        "num_processes": accelerator.num_processes,
        "exact": exact.compute(),
        "synced_padded": synced_padded.compute(),
        "synced_uneven": synced_uneven.compute(),
        "local_count": local_result["count"],
        "naive_top1": per_process_top1.mean().item(),
    }
    (Path(out_dir) / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def two_process_records(tmp_path_factory):
    from accelerate import debug_launcher

    out_dir = tmp_path_factory.mktemp("accel2")
    debug_launcher(fork_safe(_two_process_metrics), args=(str(out_dir),), num_processes=2)
    records = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["num_processes"] == 2 for r in records)
    return out_dir, records


@pytest.mark.slow
def test_gathered_metrics_count_exactly_n_samples_on_two_processes(two_process_records):
    _, records = two_process_records
    assert N_SAMPLES % (2 * BATCH_SIZE) != 0
    for rec in records:
        assert rec["exact"]["count"] == N_SAMPLES, rec
    # Without gather_for_metrics the padded last batch is counted: more samples than the dataset has.
    assert sum(rec["local_count"] for rec in records) > N_SAMPLES


@pytest.mark.slow
def test_two_process_metrics_equal_single_process_top1_top5_and_loss(two_process_records):
    _, records = two_process_records
    ds = make_logits_dataset()
    single = ClassificationMetrics(NUM_CLASSES)
    single.update(*ds.tensors, torch.nn.functional.cross_entropy(*ds.tensors, reduction="none"))
    single, expected = single.compute(), reference_metrics(ds)
    for rec in records:
        assert rec["exact"]["top1"] == single["top1"] and rec["exact"]["top5"] == single["top5"], rec
        assert rec["exact"]["loss"] == pytest.approx(single["loss"], rel=1e-9)
        for key in ["top1", "top5", "loss"]:  # and the single-process numbers are the true ones
            assert rec["exact"][key] == pytest.approx(expected[key], rel=1e-6), key


@pytest.mark.slow
def test_averaging_per_process_accuracies_gives_a_biased_top1(two_process_records):
    _, records = two_process_records
    expected = reference_metrics(make_logits_dataset())["top1"]
    assert abs(records[0]["naive_top1"] - expected) > 1.0, (records[0]["naive_top1"], expected)


@pytest.mark.slow
def test_metrics_logger_writes_once_on_two_processes(two_process_records):
    out_dir, records = two_process_records
    assert read_metrics(out_dir / "metrics.jsonl") == [{"rank": 0}]


@pytest.mark.slow
def test_sync_on_compute_sums_local_states_exactly_without_padding(two_process_records):
    _, records = two_process_records
    ds = make_logits_dataset()
    single = ClassificationMetrics(NUM_CLASSES)
    single.update(*ds.tensors, torch.nn.functional.cross_entropy(*ds.tensors, reduction="none"))
    single = single.compute()
    for rec in records:
        assert rec["synced_uneven"]["count"] == N_SAMPLES, rec["synced_uneven"]
        assert rec["synced_uneven"]["top1"] == single["top1"] and rec["synced_uneven"]["top5"] == single["top5"]
        assert rec["synced_uneven"]["loss"] == pytest.approx(single["loss"], rel=1e-9)
        # With the default even_batches the padded duplicates are summed too: the documented caveat.
        assert rec["synced_padded"]["count"] == 2 * BATCH_SIZE * math.ceil(N_SAMPLES / (2 * BATCH_SIZE))


THREADS_SCRIPT = """
import json, sys
import torch
from accelerate import debug_launcher

sys.path.insert(0, sys.argv[3])
threads, out = int(sys.argv[1]), sys.argv[2]


def worker():
    torch.set_num_threads(threads)  # inside the worker: OMP_NUM_THREADS alone may give fewer threads
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from tutorial_lib.accel import ClassificationMetrics
    from test_accel import BATCH_SIZE, NUM_CLASSES, make_logits_dataset

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(make_logits_dataset(), batch_size=BATCH_SIZE, shuffle=False))
    exact = ClassificationMetrics(NUM_CLASSES)
    for logits, labels in loader:
        exact.gather_update(accelerator, logits, labels,
                            torch.nn.functional.cross_entropy(logits, labels, reduction="none"))
    if accelerator.is_main_process:
        json.dump({**exact.compute(), "threads": torch.get_num_threads()}, open(out, "w"))


debug_launcher(worker, num_processes=2)
"""


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 4, pytest.param(2, marks=pytest.mark.full_matrix)])
def test_two_process_exact_metrics_hold_their_tolerance_at_any_thread_count(tmp_path, threads):
    """06's check: counts and accuracies exactly, the loss within 1e-9. Each sample's loss is computed alone, in
    float32, the same on any process; only the float64 sum runs in another order on 2 processes than on 1, an
    error of at most 37 additions x 1.1e-16 relative, far below 1e-9. A fresh interpreter per thread count: a
    process whose OpenMP threads already ran can hang the workers it forks."""
    out = tmp_path / "exact.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(
        [sys.executable, "-c", THREADS_SCRIPT, str(threads), str(out), str(Path(__file__).parent)],
        env=env,
        check=True,
        timeout=180,
        cwd=ROOT,
    )
    got, ds = json.loads(out.read_text()), make_logits_dataset()
    single = ClassificationMetrics(NUM_CLASSES)  # the same metric on one process, over the same samples
    single.update(*ds.tensors, torch.nn.functional.cross_entropy(*ds.tensors, reduction="none"))
    single = single.compute()
    assert got["threads"] == threads
    assert got["count"] == N_SAMPLES and got["top1"] == single["top1"] and got["top5"] == single["top5"], (got, single)
    assert abs(got["loss"] - single["loss"]) < 1e-9, (got, single)


# ---- --mixed_precision auto ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "capability, chosen",
    [
        ((7, 0), "fp16"),
        ((7, 5), "fp16"),
        ((8, 0), "bf16"),
        ((8, 6), "bf16"),
        ((8, 9), "bf16"),
        ((9, 0), "bf16"),
        (None, "no"),
    ],
)  # V100, T4, A100, A10/RTX 30xx, L4, H100, no GPU
def test_auto_mixed_precision_picks_bf16_only_where_the_gpu_has_it_natively(capability, chosen):
    from tutorial_lib.accel import auto_mixed_precision

    precision, why = auto_mixed_precision(capability)
    assert precision == chosen and why


def test_auto_reads_the_capability_of_this_process_gpu(monkeypatch):
    from tutorial_lib import accel

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (7, 5))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert accel._device_capability(asked_cpu=False) == (7, 5) and asked == [1], "the GPU of LOCAL_RANK"
    assert accel.auto_mixed_precision(accel._device_capability(asked_cpu=False))[0] == "fp16"  # a T4
    assert accel._device_capability(asked_cpu=True) is None, "--cpu: no GPU asked about"


def test_build_accelerator_auto_on_a_cpu_trains_in_fp32_and_says_why(capsys):
    from tutorial_lib.accel import build_accelerator

    accelerator = build_accelerator(cpu=True, mixed_precision="auto")
    assert accelerator.mixed_precision == "no"
    assert "mixed precision auto: no: no GPU" in capsys.readouterr().out


def test_the_training_flags_accept_auto():
    from tutorial_lib.flags import default_args

    assert default_args(mixed_precision="auto").mixed_precision == "auto"
