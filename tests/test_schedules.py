import json
import math
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from tutorial_lib.core import fork_safe, free_port
from tutorial_lib.schedules import build_scheduler, lr_curve, num_optimizer_steps, scaled_lr

BASE, T, W, S = 0.1, 100, 10, 0.01


def warm(t):
    return BASE * (S + (1 - S) * t / W)


# Hand-written formulas, independent of lr_factor.
EXPECTED = {
    "constant": ({}, {0: BASE * S, 5: warm(5), 10: BASE, 99: BASE}),
    "step": (
        dict(step_size=40, gamma=0.5),
        {0: BASE * S, 10: BASE, 39: BASE, 40: BASE / 2, 80: BASE / 4, 99: BASE / 4},
    ),
    "multistep": (dict(milestones=[30, 70]), {9: warm(9), 29: BASE, 30: BASE * 0.1, 69: BASE * 0.1, 70: BASE * 0.01}),
    "cosine": (
        {},
        {
            0: BASE * S,
            10: BASE,
            55: BASE / 2,
            77: BASE * 0.5 * (1 + math.cos(math.pi * 67 / 90)),
            99: BASE * 0.5 * (1 + math.cos(math.pi * 89 / 90)),
        },
    ),
    "linear": ({}, {10: BASE, 55: BASE / 2, 99: BASE / 90}),
    "onecycle": (
        {},
        {
            0: BASE * S,
            5: warm(5),
            10: BASE,
            15: BASE * (1 - (1 - S) * 0.5),
            20: BASE * S,
            60: BASE * S * (1 - 40 / 80),
            99: BASE * S / 80,
        },
    ),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_schedule_equals_hand_written_formula_at_chosen_steps(name):
    kwargs, points = EXPECTED[name]
    lrs = lr_curve(name, T, base_lr=BASE, warmup_steps=W, warmup_start_factor=S, **kwargs)
    assert len(lrs) == T
    for t, want in points.items():
        assert lrs[t] == pytest.approx(want, rel=1e-9, abs=1e-12), f"{name} at step {t}"


@pytest.mark.parametrize("name", ["cosine", "linear", "onecycle"])
def test_decaying_schedules_end_at_min_lr_for_every_param_group(name):
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.05}], lr=0.1)
    scheduler = build_scheduler(optimizer, name, total_steps=20, warmup_steps=5, min_lr=1e-3)
    for _ in range(20):
        optimizer.step()
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-3, 1e-3])


def test_no_warmup_starts_at_the_base_lr():
    assert lr_curve("cosine", 10, base_lr=0.3)[0] == pytest.approx(0.3)


def test_resuming_from_state_dict_continues_on_the_same_curve():
    full = lr_curve("cosine", 30, base_lr=BASE, warmup_steps=5)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=BASE)
    scheduler = build_scheduler(optimizer, "cosine", 30, warmup_steps=5)
    for _ in range(12):
        optimizer.step()
        scheduler.step()
    # A checkpoint holds both (accelerator.save_state saves both): the optimizer carries the current lr.
    opt_state, sched_state = optimizer.state_dict(), scheduler.state_dict()
    optimizer2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=BASE)
    scheduler2 = build_scheduler(optimizer2, "cosine", 30, warmup_steps=5)
    optimizer2.load_state_dict(opt_state)
    scheduler2.load_state_dict(sched_state)
    resumed = []
    for _ in range(12, 30):
        resumed.append(optimizer2.param_groups[0]["lr"])
        optimizer2.step()
        scheduler2.step()
    assert resumed == pytest.approx(full[12:])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="cosinus"), "unknown schedule"),
        (dict(name="cosine", total_steps=0), "total_steps"),
        (dict(name="cosine", warmup_steps=100), "warmup_steps"),
        (dict(name="cosine", warmup_start_factor=0.0), "warmup_start_factor"),
        (dict(name="step"), "step_size"),
        (dict(name="multistep", milestones=[50, 20]), "milestones"),
        (dict(name="onecycle", warmup_steps=0), "onecycle"),
        (dict(name="onecycle", warmup_steps=60), "onecycle"),
        (dict(name="cosine", min_lr=1.0), "min_lr"),
    ],
)
def test_bad_arguments_are_refused_with_a_message_saying_what_to_change(kwargs, match):
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=BASE)
    args = {"total_steps": 100, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_scheduler(optimizer, **args)


def _count_loop(batches, accum, epochs):
    return sum(1 for _ in range(epochs) for i in range(batches) if (i + 1) % accum == 0 or i + 1 == batches)


@pytest.mark.parametrize(
    "batches, accum, epochs", [(10, 1, 3), (10, 3, 3), (9, 3, 2), (7, 4, 5), (1, 8, 2), (5004, 1, 90)]
)
def test_num_optimizer_steps_counts_incomplete_windows(batches, accum, epochs):
    assert num_optimizer_steps(batches, accum, epochs) == _count_loop(batches, accum, epochs)


def test_num_optimizer_steps_refuses_non_positive_counts():
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        num_optimizer_steps(10, 0, 1)


def test_scaled_lr_is_linear_in_the_global_batch():
    assert scaled_lr(256) == pytest.approx(0.1)
    assert scaled_lr(8192) == pytest.approx(3.2)
    assert scaled_lr(512, base_lr=0.2, reference_batch_size=128) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        scaled_lr(0)


# ---- real multi-process runs (gloo, accelerate's debug_launcher) --------------------------------
EPOCHS, WARMUP = 2, 2


def _trace(accumulation, per_optimizer_step):
    from accelerate import Accelerator

    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=accumulation, step_scheduler_with_optimizer=not per_optimizer_step
    )
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(44, 3, generator=g), torch.randn(44, 1, generator=g))
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE)
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    total = num_optimizer_steps(len(loader), accumulation, EPOCHS)
    scheduler = accelerator.prepare(build_scheduler(optimizer, "cosine", total, warmup_steps=WARMUP))
    lrs = []
    for _ in range(EPOCHS):
        for x, y in loader:
            with accelerator.accumulate(model):
                if accelerator.sync_gradients:
                    lrs.append(optimizer.param_groups[0]["lr"])
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                if not per_optimizer_step:
                    scheduler.step()
                optimizer.zero_grad()
            if per_optimizer_step and accelerator.sync_gradients:
                scheduler.step()
    return {
        "accumulation": accumulation,
        "per_optimizer_step": per_optimizer_step,
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "batches": len(loader),
        "total": total,
        "lrs": lrs,
    }


def _worker(out_dir):
    results = [_trace(a, mode) for a in (1, 3) for mode in (True, False)]
    Path(out_dir, f"rank{results[0]['process_index']}.json").write_text(json.dumps(results))


def _launch(num_processes):
    from accelerate import debug_launcher
    from accelerate.utils import patch_environment

    with (
        tempfile.TemporaryDirectory() as out_dir,
        patch_environment(master_port=str(free_port())),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        debug_launcher(fork_safe(_worker), args=(out_dir,), num_processes=num_processes)
        return [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]


def _formula(t, total):
    if t < WARMUP:
        return BASE * (S + (1 - S) * t / WARMUP)
    return BASE * 0.5 * (1 + math.cos(math.pi * min(t - WARMUP, total - WARMUP) / (total - WARMUP)))


@pytest.mark.slow
@pytest.mark.parametrize("num_processes", [1, 2])
def test_schedule_follows_formula_per_optimizer_step_with_accumulation_1_and_3_on_real_processes(num_processes):
    per_rank = _launch(num_processes)
    assert len(per_rank) == num_processes, "every process must report"
    for results in per_rank:
        for r in results:
            assert r["num_processes"] == num_processes
            assert r["batches"] == 22 // num_processes
            steps = num_optimizer_steps(r["batches"], r["accumulation"], EPOCHS)
            assert len(r["lrs"]) == steps == r["total"], r
            # ours: once per optimizer step; accelerate's default: once per process per optimizer step
            k = 1 if r["per_optimizer_step"] else num_processes
            want = [_formula(k * t, steps) for t in range(steps)]
            assert r["lrs"] == pytest.approx(want, rel=1e-9, abs=1e-12), (num_processes, r["accumulation"], k)
