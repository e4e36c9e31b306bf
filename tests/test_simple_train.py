"""The one-file training script `tutorial_lib.simple_train` (notebook 08): it stands alone (no import of the course,
at most 350 lines), keeps the video's flags, runs on 1 process and on 2 (gloo), resumes bit for bit, and trains as
well as the production script `tutorial-train` (08b).

Runs are small: ResNet18 or MobileNetV3 (small) at 16-32 px on a few hundred images of the embedded dataset, linked
into a folder of the same layout."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tutorial_lib import simple_train
from tutorial_lib.core import free_port, linked_subset
from tutorial_lib.sources import embedded_data_path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tutorial_lib" / "simple_train.py"
ALLOWED = {"torch", "torchvision", "accelerate", "torchmetrics", "wandb"}


def subset(folder: Path, per_class_train: int, per_class_val: int) -> Path:
    """The first images of every class of the embedded data, linked into `folder` (train/ and val/)."""
    return linked_subset(embedded_data_path(), folder, {"train": per_class_train, "val": per_class_val})


def flags(**options) -> list[str]:
    out = []
    for key, value in options.items():
        out += [f"--{key}"] if value is True else [] if value is False else [f"--{key}", str(value)]
    return out


def run_in_process(**options) -> dict:
    """`simple_train.main` in this process; afterwards the process forgets the run's Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    try:
        return simple_train.main(flags(**{"cpu": True, "log_with": "none", **options}))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def rows(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---- the file itself -------------------------------------------------------------------------------------------


def test_module_imports_nothing_from_the_course():
    tree = ast.parse(SOURCE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import at line {node.lineno}: the file must stand alone"
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
    assert "tutorial_lib" not in imported
    assert imported <= ALLOWED | set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_module_is_at_most_350_lines():
    assert len(SOURCE.read_text().splitlines()) <= 350


def test_every_fixed_line_names_a_notebook_of_the_course():
    fixes = re.findall(r"# fixed \((\w+)\):", SOURCE.read_text())
    assert len(fixes) == 12, "one line per bug of the video's script (08b §11 lists twelve)"
    for number in set(fixes):
        assert list((ROOT / "notebooks").glob(f"{number}_*.ipynb")), f"no notebook {number} for a fixed line"


def test_the_videos_readme_command_parses_with_its_warmup_flag():
    readme = (
        "--experiment_name=ResNet50 --path_to_data=/data --working_directory=/work --num_classes=1000 "
        "--epochs=90 --save_checkpoint_interval=2 --batch_size=512 --gradient_accumulation_steps=1 "
        "--learning_rate=0.1 --weight_decay=1e-4 --momentum=0.9 --step_lr_decay=0.1 --lr_step_size=30 "
        "--warmup_epochs=5 --lr_warmup_start_factor=0.1 --max_grad_norm=1.0 --img_size=224 --num_workers=18"
    )
    args = simple_train.get_args_parser().parse_args(readme.split())
    assert args.lr_warmup_epochs == 5 and args.batch_size == 512 and args.max_grad_norm == 1.0


@pytest.mark.parametrize(
    "bad",
    [
        ["--path_to_data", "/no/such/folder"],
        ["--path_to_data", ".", "--epochs", "0"],
        ["--path_to_data", ".", "--batch_size", "-4"],
    ],
    ids=["path", "epochs", "batch"],
)
def test_a_bad_flag_or_path_is_one_line_and_exit_2(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        simple_train.main(bad)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("simple_train: error: "), err


# ---- its pieces ------------------------------------------------------------------------------------------------


def test_schedule_is_the_course_schedule_step_for_step():
    from tutorial_lib.schedules import lr_curve

    parser = simple_train.get_args_parser()
    for schedule, extra in [("cosine", []), ("step", ["--lr_step_size", "2", "--step_lr_decay", "0.5"])]:
        args = parser.parse_args(
            [
                "--path_to_data",
                ".",
                "--epochs",
                "5",
                "--learning_rate",
                "0.2",
                "--lr_scheduler",
                schedule,
                "--lr_warmup_epochs",
                "1.5",
                *extra,
            ]
        )
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
        scheduler, ours = simple_train.build_scheduler(optimizer, args, steps_per_epoch=10), []
        for _ in range(50):
            ours.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        course = lr_curve(schedule, 50, base_lr=0.2, warmup_steps=15, warmup_start_factor=0.01, step_size=20, gamma=0.5)
        assert ours == pytest.approx(course, abs=1e-12), schedule


def test_param_groups_exempt_every_norm_layer_and_bias_only_when_asked():
    model = simple_train.build_model("resnet50", 10)
    parser = simple_train.get_args_parser()
    exempting = parser.parse_args(["--path_to_data", ".", "--no-norm_weight_decay", "--no-bias_weight_decay"])
    decayed, exempt = simple_train.param_groups(model, exempting)
    norm_params = {id(p) for m in model.modules() if isinstance(m, simple_train.NORMS) for p in m.parameters()}
    biases = {id(p) for name, p in model.named_parameters() if name.endswith(".bias")}
    assert {id(p) for p in exempt["params"]} == norm_params | biases  # the 4 downsample.1 BatchNorms included
    assert len(exempt["params"]) == 107 and exempt["weight_decay"] == 0.0
    v1 = simple_train.param_groups(model, parser.parse_args(["--path_to_data", "."]))
    assert len(v1[1]["params"]) == 0 and len(v1[0]["params"]) == len(list(model.parameters()))


def test_crops_depend_on_seed_epoch_and_index_only():
    parser = simple_train.get_args_parser()
    train_ds, _ = simple_train.load_data(
        parser.parse_args(["--path_to_data", str(embedded_data_path()), "--img_size", "16"])
    )
    first = train_ds[3][0]
    torch.rand(100)  # the process's random state moves: the crop must not
    assert torch.equal(train_ds[3][0], first)
    train_ds.epoch = 1
    assert not torch.equal(train_ds[3][0], first)


# ---- runs ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_help_and_a_one_process_run_from_the_command_line_logging_to_wandb_offline_without_a_key(tmp_path):
    data = subset(tmp_path / "data", 5, 3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "no_netrc"), WANDB_SILENT="true", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "tutorial_lib.simple_train"]
    help_text = subprocess.run([*command, "--help"], env=env, capture_output=True, text=True, check=True).stdout
    assert "the video's flags" in help_text and "PER PROCESS" in help_text
    done = subprocess.run(
        [
            *command,
            *flags(
                path_to_data=data,
                working_directory=tmp_path / "runs",
                cpu=True,
                model="resnet18",
                img_size=16,
                batch_size=8,
                epochs=2,
                num_workers=0,
                experiment_name="one",
            ),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "one"
    assert [r["epoch"] for r in rows(run_dir)] == [0, 1] and all(r["val_count"] == 30 for r in rows(run_dir))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000000006", "step_000000012"]
    assert (run_dir / "model.safetensors").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*")), "W&B must log offline when it finds no key"


@pytest.mark.slow
def test_two_processes_count_every_validation_image_once_and_agree_with_one(tmp_path):
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    data = subset(tmp_path / "data", 8, 5)  # 50 validation images: 7 batches of 8, one process gets a padded 8th
    options = dict(
        path_to_data=data,
        working_directory=tmp_path / "runs",
        cpu=True,
        model="resnet18",
        img_size=32,
        batch_size=8,
        learning_rate=0.01,
        epochs=1,
        num_workers=0,
        log_with="none",
        experiment_name="two",
    )
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        "-m",
        "tutorial_lib.simple_train",
        *flags(**options),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-5000:]
    assert done.stdout.count("val_count") == 1, "only the main process prints"
    two = rows(tmp_path / "runs" / "two")[-1]
    # DDP gives every process process 0's BatchNorm statistics at each forward: both evaluate the saved network
    args = simple_train.get_args_parser().parse_args(flags(**options))
    args.num_classes = 10
    model = simple_train.build_model("resnet18", 10)
    model.load_state_dict(load_file(tmp_path / "runs" / "two" / "model.safetensors"))
    accelerator = Accelerator(cpu=True)
    loader = DataLoader(simple_train.load_data(args)[1], batch_size=8)
    one = simple_train.evaluate(*accelerator.prepare(model, loader), accelerator, args)
    assert two["val_count"] == one["val_count"] == 50
    assert two["val_top1"] == one["val_top1"] and two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_resume_at_an_epoch_end_and_in_the_middle_of_an_epoch_is_bit_identical(tmp_path):
    data = subset(tmp_path / "data", 10, 3)  # 100 images, batches of 16: 6 optimizer steps per epoch
    # MobileNetV3: BatchNorm statistics and dropout masks (the process's random state) must both come back
    common = dict(
        path_to_data=data,
        working_directory=tmp_path,
        model="mobilenet_v3_small",
        img_size=32,
        batch_size=16,
        learning_rate=0.05,
        lr_scheduler="cosine",
        epochs=2,
        num_workers=1,
    )
    run_in_process(**common, experiment_name="straight")
    run_in_process(
        **common,
        experiment_name="from_epoch_end",
        resume_from_checkpoint=tmp_path / "straight" / "checkpoints" / "step_000000006",
    )
    run_in_process(**common, experiment_name="with_steps", checkpoint_every_steps=4)
    assert sorted(p.name for p in (tmp_path / "with_steps" / "checkpoints").iterdir()) == [
        "step_000000008",
        "step_000000012",
    ]  # the two newest: step 8 is 2 micro-batches into epoch 1
    run_in_process(
        **{**common, "num_workers": 0},
        experiment_name="from_mid_epoch",
        resume_from_checkpoint=tmp_path / "with_steps" / "checkpoints" / "step_000000008",
    )
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    for name in ["from_epoch_end", "with_steps", "from_mid_epoch"]:
        resumed = load_file(tmp_path / name / "model.safetensors")
        assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight), name
    assert [r["epoch"] for r in rows(tmp_path / "from_epoch_end")] == [0, 1]


@pytest.mark.slow
def test_latest_resumes_the_newest_checkpoint_and_starts_fresh_without_one(tmp_path):
    data = subset(tmp_path / "data", 4, 2)
    common = dict(
        path_to_data=data,
        working_directory=tmp_path,
        model="resnet18",
        img_size=16,
        batch_size=8,
        num_workers=0,
        experiment_name="job",
    )
    run_in_process(**common, epochs=1, resume_from_checkpoint="latest")  # no checkpoint yet: a fresh start
    assert sorted(p.name for p in (tmp_path / "job" / "checkpoints").iterdir()) == ["step_000000005"]
    last = run_in_process(**common, epochs=2, resume_from_checkpoint="latest")  # longer: continues after epoch 0
    assert last["epoch"] == 1 and [r["epoch"] for r in rows(tmp_path / "job")] == [0, 1]
    # a folder named inside the run's folder, as the video's flag took it: back to the end of epoch 0
    run_in_process(**common, epochs=2, resume_from_checkpoint="checkpoints/step_000000005")
    assert [r["epoch"] for r in rows(tmp_path / "job")] == [0, 1]


# The README's recipe, shrunk to what a test can afford: ResNet18 at 16 px, 1,000 training and 400 validation images,
# 3 epochs (a run takes about 12 s on one core).
EQUIVALENCE = dict(
    model="resnet18",
    img_size=16,
    min_crop_scale=0.5,
    epochs=3,
    batch_size=16,
    learning_rate=0.05,
    lr_scheduler="cosine",
    lr_warmup_epochs=0.5,
    zero_init_residual=True,
    label_smoothing=0.1,
    num_workers=0,
    cpu=True,
    log_with="none",
)
# Measured once with these settings (seeds 2-9, other than the test's, in-process, on a 2-core VM): the final top-1
# of one run moves from seed to seed with a standard deviation of 1.6 points for the one-file script (mean 24.9 %,
# lowest 21.75 %) and 1.9 for tutorial-train (mean 24.5 %, lowest 22.0 %). With 2 seeds each, the gap between the
# two means has a standard deviation of about 1.7 points; 7 points is about 4 of them: two scripts that train alike
# fail this test far less than 1 % of the time; the floor of 14 % lies about 6 standard deviations below both means
# (the lowest run measured: 21.75 %). A script stuck near chance (10 %) while the other learns fails both checks.
TOLERANCE = 7.0


@pytest.mark.slow
def test_trains_as_well_as_the_production_script(tmp_path):
    from tutorial_lib.flags import default_args
    from tutorial_lib.train import train

    data = subset(tmp_path / "data", 100, 40)  # 1,000 training and 400 validation images
    simple, production = [], []
    for seed in [0, 1]:
        options = {**EQUIVALENCE, "path_to_data": str(data), "working_directory": str(tmp_path), "seed": seed}
        simple.append(run_in_process(**options, experiment_name=f"simple_{seed}")["val_top1"])
        production.append(
            train(default_args(**options, experiment_name=f"train_{seed}", disable_progress_bar=True))["val_top1"]
        )
    gap = abs(sum(simple) / 2 - sum(production) / 2)
    assert min(simple + production) > 14, (simple, production)  # chance is 10 %
    assert gap <= TOLERANCE, f"one-file {simple} vs tutorial-train {production}: means {gap:.1f} points apart"
