"""tutorial_lib.accel: printing/logging once, W&B mode without the network, exact metrics across processes.

The distributed tests run 2 real CPU processes (gloo) with `accelerate.debug_launcher`; the launched
functions live at module level so they can be pickled. debug_launcher rendezvous through a temp
file, so parallel test runs do not compete for a port.
"""
import contextlib
import io
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tutorial_lib.accel import (ClassificationMetrics, MetricsLogger, launch_with_timeout, read_metrics,
                                resolve_wandb_mode, wandb_api_key_configured)

NUM_CLASSES = 10
N_SAMPLES = 37   # does not divide by num_processes (2) x batch_size (4)
BATCH_SIZE = 4


def make_logits_dataset(n: int = N_SAMPLES, num_classes: int = NUM_CLASSES) -> TensorDataset:
    """Fixed 'predictions' and labels: the first samples are classified right, the last ones wrong.

    The dataset's start is what `even_batches` pads the last batch with, so counting padding (or
    averaging per-process means) visibly moves the accuracy."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    logits = torch.randn(n, num_classes, generator=g)
    right = torch.arange(n) < n // 3
    logits[right, labels[right]] += 10.0                      # confidently right
    logits[~right, labels[~right]] -= 10.0                    # confidently wrong (outside the top 5)
    return TensorDataset(logits, labels)


def reference_metrics(ds: TensorDataset) -> dict:
    """Top-1/top-5/loss over the whole dataset in one process, computed directly."""
    logits, labels = ds.tensors
    top5 = logits.topk(5, dim=1).indices
    return {"top1": 100 * (top5[:, 0] == labels).double().mean().item(),
            "top5": 100 * (top5 == labels[:, None]).any(1).double().mean().item(),
            "loss": torch.nn.functional.cross_entropy(logits, labels).item(), "count": len(labels)}


# --------------------------------------------------------------------------- unit tests

def test_metrics_logger_appends_one_json_line_per_call_with_tensors_as_numbers(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"     # parent folder does not exist yet
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


@pytest.fixture
def no_wandb_config(monkeypatch, tmp_path):
    """An environment with no W&B variables and an empty home (no .netrc)."""
    for var in ["WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_BASE_URL"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-such-netrc"))
    return tmp_path


def test_resolve_wandb_mode_is_offline_without_an_api_key(no_wandb_config):
    assert not wandb_api_key_configured()
    assert resolve_wandb_mode() == "offline"


def test_resolve_wandb_mode_is_online_with_a_key_in_the_environment(no_wandb_config, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode() == "online"


def test_resolve_wandb_mode_is_online_with_a_netrc_entry(no_wandb_config, monkeypatch):
    netrc_file = no_wandb_config / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert resolve_wandb_mode() == "online"


@pytest.mark.parametrize("explicit,expected", [("disabled", "disabled"), ("offline", "offline"),
                                               ("ONLINE", "online"), ("dryrun", "offline")])
def test_resolve_wandb_mode_respects_an_explicit_wandb_mode(no_wandb_config, monkeypatch, explicit, expected):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)       # an explicit mode beats a configured key
    monkeypatch.setenv("WANDB_MODE", explicit)
    assert resolve_wandb_mode() == expected


def test_resolve_wandb_mode_refuses_an_unknown_mode(no_wandb_config, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ValueError, match="WANDB_MODE"):
        resolve_wandb_mode()


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

    exact = ClassificationMetrics(NUM_CLASSES)                     # gather_for_metrics, then count
    local = ClassificationMetrics(NUM_CLASSES)                     # this process's samples only
    for logits, labels in loader:
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        exact.gather_update(accelerator, logits, labels, loss)
        local.update(logits, labels, loss)
    local_result = local.compute()

    # sync_on_compute=True: update with local tensors, torchmetrics sums the states at compute().
    synced_padded = ClassificationMetrics(NUM_CLASSES, sync_on_compute=True)
    for logits, labels in loader:                                  # default even_batches: padded
        synced_padded.update(logits, labels, torch.nn.functional.cross_entropy(logits, labels, reduction="none"))
    accelerator.even_batches = False                               # uneven last batch, no padding
    uneven_loader = accelerator.prepare(DataLoader(ds, batch_size=BATCH_SIZE, shuffle=False))
    synced_uneven = ClassificationMetrics(NUM_CLASSES, sync_on_compute=True)
    for logits, labels in uneven_loader:
        synced_uneven.update(logits, labels, torch.nn.functional.cross_entropy(logits, labels, reduction="none"))
    # The pitfall: gather each process's accuracy and average those scalars.
    per_process_top1 = accelerator.gather(torch.tensor([local_result["top1"]], dtype=torch.float64))

    MetricsLogger(Path(out_dir) / "metrics.jsonl", accelerator).log({"rank": accelerator.process_index})

    record = {"num_processes": accelerator.num_processes, "exact": exact.compute(),
              "synced_padded": synced_padded.compute(), "synced_uneven": synced_uneven.compute(),
              "local_count": local_result["count"], "naive_top1": per_process_top1.mean().item()}
    (Path(out_dir) / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def two_process_records(tmp_path_factory):
    from accelerate import debug_launcher

    out_dir = tmp_path_factory.mktemp("accel2")
    debug_launcher(_two_process_metrics, args=(str(out_dir),), num_processes=2)
    records = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["num_processes"] == 2 for r in records)
    return out_dir, records


def test_gathered_metrics_count_exactly_n_samples_on_two_processes(two_process_records):
    _, records = two_process_records
    assert N_SAMPLES % (2 * BATCH_SIZE) != 0
    for rec in records:
        assert rec["exact"]["count"] == N_SAMPLES, rec
    # Without gather_for_metrics the padded last batch is counted: more samples than the dataset has.
    assert sum(rec["local_count"] for rec in records) > N_SAMPLES


def test_two_process_metrics_equal_single_process_top1_top5_and_loss(two_process_records):
    _, records = two_process_records
    ds = make_logits_dataset()
    single = ClassificationMetrics(NUM_CLASSES)
    single.update(*ds.tensors, torch.nn.functional.cross_entropy(*ds.tensors, reduction="none"))
    single, expected = single.compute(), reference_metrics(ds)
    for rec in records:
        assert rec["exact"]["top1"] == single["top1"] and rec["exact"]["top5"] == single["top5"], rec
        assert rec["exact"]["loss"] == pytest.approx(single["loss"], rel=1e-9)
        for key in ["top1", "top5", "loss"]:   # and the single-process numbers are the true ones
            assert rec["exact"][key] == pytest.approx(expected[key], rel=1e-6), key


def test_averaging_per_process_accuracies_gives_a_biased_top1(two_process_records):
    _, records = two_process_records
    expected = reference_metrics(make_logits_dataset())["top1"]
    assert abs(records[0]["naive_top1"] - expected) > 1.0, (records[0]["naive_top1"], expected)


def test_metrics_logger_writes_once_on_two_processes(two_process_records):
    out_dir, records = two_process_records
    assert read_metrics(out_dir / "metrics.jsonl") == [{"rank": 0}]


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


def hang_once_on_rank_1(marker: str) -> None:
    """A launched function whose first launch hangs on rank 1 (as a worker that inherited a held lock does)."""
    import time

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    first_launch = not Path(marker).exists()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        Path(marker).write_text(Path(marker).read_text() + "x" if Path(marker).exists() else "x")
    if first_launch and accelerator.process_index == 1:
        time.sleep(600)
    accelerator.wait_for_everyone()
    Path(f"{marker}.done{accelerator.process_index}").write_text(str(accelerator.num_processes))


@pytest.mark.slow
def test_launch_with_timeout_kills_a_hung_launch_and_starts_it_again(tmp_path):
    marker = str(tmp_path / "launches")
    start = time.perf_counter()
    launch_with_timeout(hang_once_on_rank_1, (marker,), num_processes=2, timeout=15)
    assert Path(marker).read_text() == "xx", "expected exactly two launches"
    assert [Path(f"{marker}.done{r}").read_text() for r in (0, 1)] == ["2", "2"]
    assert time.perf_counter() - start < 60
    assert not multiprocessing.active_children(), "the killed workers were not reaped"


@pytest.mark.slow
def test_launch_with_timeout_gives_up_after_its_attempts(tmp_path):
    marker = str(tmp_path / "launches")
    with pytest.raises(Exception):
        launch_with_timeout(hang_once_on_rank_1, (marker,), num_processes=2, timeout=10, attempts=1)
    assert Path(marker).read_text() == "x"


def note_threads(out: str) -> None:
    """A launched function that notes its OMP_NUM_THREADS and torch thread count, per rank."""
    import warnings

    from accelerate import Accelerator

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(cpu=True)
    Path(f"{out}.{accelerator.process_index}").write_text(json.dumps(
        [os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads(), [str(w.message) for w in caught]]))


@pytest.mark.slow
def test_launched_processes_compute_on_one_thread_without_accelerates_warning(tmp_path, monkeypatch, capsys):
    """Forked from a process that has computed with OpenMP threads, a worker's first multi-threaded operation
    hangs (GCC's libgomp after fork): each launched process runs on one thread unless OMP_NUM_THREADS says
    otherwise, set in torch itself (a forked process keeps its parent's count whatever the variable says)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    torch.ones(512, 512) @ torch.ones(512, 512)  # this process has now used its OpenMP threads
    out = str(tmp_path / "threads")
    launch_with_timeout(note_threads, (out,), num_processes=2, timeout=120)
    for rank in (0, 1):
        variable, threads, warned = json.loads(Path(f"{out}.{rank}").read_text())
        assert (variable, threads) == ("1", 1)
        assert not any("OMP_NUM_THREADS" in w for w in warned), warned
    assert "OMP_NUM_THREADS" not in os.environ, "the launching process's environment is restored"
    assert "Launching training on" not in capsys.readouterr().out, "no 'N CUDAs' banner on a CPU"


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
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_two_process_exact_metrics_hold_their_tolerance_at_any_thread_count(tmp_path, threads):
    """06's check: counts and accuracies exactly, the loss within 1e-9. Each sample's loss is computed alone, in
    float32, the same on any process; only the float64 sum runs in another order on 2 processes than on 1, an
    error of at most 37 additions x 1.1e-16 relative, far below 1e-9. A fresh interpreter per thread count: a
    process whose OpenMP threads already ran can hang the workers it forks."""
    out = tmp_path / "exact.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([sys.executable, "-c", THREADS_SCRIPT, str(threads), str(out), str(Path(__file__).parent)],
                   env=env, check=True, timeout=180, cwd=ROOT)
    got, ds = json.loads(out.read_text()), make_logits_dataset()
    single = ClassificationMetrics(NUM_CLASSES)  # the same metric on one process, over the same samples
    single.update(*ds.tensors, torch.nn.functional.cross_entropy(*ds.tensors, reduction="none"))
    single = single.compute()
    assert got["threads"] == threads
    assert got["count"] == N_SAMPLES and got["top1"] == single["top1"] and got["top5"] == single["top5"], (got, single)
    assert abs(got["loss"] - single["loss"]) < 1e-9, (got, single)


# --- an offline W&B run, written by the trackers of the training script and read back -------------------

def log_offline(run_dir: Path, first_step: int, steps: int) -> str:
    """One start of a run's logging as the training script does it (`start_trackers` with a fixed run id)."""
    from accelerate import Accelerator
    from tutorial_lib.accel import start_trackers

    accelerator = Accelerator(cpu=True, log_with="wandb", project_dir=str(run_dir))
    mode = start_trackers(accelerator, "tests", config={"lr": 0.25, "model": "tinycnn"}, run_id="offlinetest",
                          name="offline", run_dir=run_dir)
    for step in range(first_step, first_step + steps):
        accelerator.log({"loss": 1.0 / (step + 1), "epoch": step // 2}, step=step)
    accelerator.end_training()
    return mode


def test_an_offline_wandb_run_and_its_resume_are_read_back_from_their_files(no_wandb_config, monkeypatch):
    from tutorial_lib.accel import read_wandb_offline_run

    monkeypatch.setenv("WANDB_MODE", "offline")  # and no key, no .netrc: nothing can reach a server
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = no_wandb_config / "run"
    run_dir.mkdir()
    assert log_offline(run_dir, 0, 4) == "offline"
    log_offline(run_dir, 4, 3)  # the resumed run: the same run id
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2, folders
    runs = [read_wandb_offline_run(folder, timeout=30) for folder in folders]  # W&B writes them a moment later
    assert [r["run_id"] for r in runs] == ["offlinetest"] * 2 and runs[0]["project"] == "tests"
    assert all(r["finished"] for r in runs)
    assert runs[0]["config"] == {"lr": 0.25, "model": "tinycnn"}, runs[0]["config"]
    rows = [row for r in runs for row in r["history"]]
    assert [row["_step"] for row in rows] == list(range(7))
    assert [row["loss"] for row in rows] == [1.0 / (s + 1) for s in range(7)] and rows[5]["epoch"] == 2
    assert runs[0]["summary"]["loss"] == 1.0 / 4 and runs[1]["summary"]["loss"] == 1.0 / 7
    assert runs[1]["summary"]["_step"] == 6


def test_reading_an_offline_wandb_run_stops_at_a_torn_record_and_refuses_other_files(tmp_path, no_wandb_config,
                                                                                        monkeypatch):
    from tutorial_lib.accel import read_wandb_offline_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = no_wandb_config / "run"
    run_dir.mkdir()
    log_offline(run_dir, 0, 5)
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    (wandb_file,) = folder.glob("run-*.wandb")
    whole = read_wandb_offline_run(folder, timeout=30)
    assert whole["finished"]
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / wandb_file.name).write_bytes(wandb_file.read_bytes()[:-20])  # a run killed while writing
    partial = read_wandb_offline_run(torn)
    assert partial["run_id"] == "offlinetest" and not partial["finished"] and len(partial["history"]) <= 5
    assert len(whole["history"]) == 5
    (torn / wandb_file.name).write_bytes(b"not a wandb file")
    with pytest.raises(ValueError, match="not a W&B run file"):
        read_wandb_offline_run(torn)
    with pytest.raises(FileNotFoundError, match="offline-run"):
        read_wandb_offline_run(tmp_path)
