"""What a launch derives from the flags (08a's `LaunchSettings`, computed once) and what a resume may change.

Pure logic: no process, no training (the fast tier)."""

import argparse
import dataclasses

import pytest
import torch

from tutorial_lib.flags import (
    NOT_RESUMABLE_FLAGS,
    RESUMABLE_FLAGS,
    BadFlagError,
    LaunchSettings,
    check_args,
    check_resume_flags,
    default_args,
    get_args_parser,
    launch_settings,
    optimisation_flags,
    resolve_learning_rate,
)
from tutorial_lib.optim import param_groups
from tutorial_lib.train import build_optimizer, build_training_scheduler, override_hyperparameters


def quiet(tmp_path, **flags) -> argparse.Namespace:
    return default_args(model="tinycnn", img_size=32, working_directory=str(tmp_path), log_with="none", **flags)


# --- derived settings: one frozen value, computed in one place ------------------------------------------------------


def test_check_args_works_on_the_parsed_defaults_alone(tmp_path):
    args = default_args(working_directory=str(tmp_path), log_with="none")
    before = vars(args).copy()
    source = check_args(args)  # no resolve_learning_rate first: the settings of one process
    assert source.kind == "folders"
    assert vars(args) == before, "check_args leaves the parsed flags as they were"


def test_check_args_alone_says_a_derived_learning_rate_was_derived(tmp_path):
    with pytest.raises(BadFlagError) as refused:
        check_args(quiet(tmp_path, lr_scheduler="cosine", lr_min=0.5))
    assert str(refused.value) == (
        "--lr_min 0.5 must be below the learning rate derived from the global batch (lr 0.0125 = 0.1 x 32 / 256; "
        "--learning_rate not given): the cosine schedule decays from the learning rate down to it"
    )


def test_launch_settings_are_frozen_and_typed():
    settings = launch_settings(default_args(batch_size=128), num_processes=8)
    assert isinstance(settings, LaunchSettings)
    assert (settings.global_batch, settings.learning_rate, settings.lr_warmup_epochs) == (1024, 0.4, 3.75)
    assert settings.lr_derived and settings.lr_warmup_derived
    assert settings.lr_origin == "lr 0.4 = 0.1 x 1024 / 256"
    assert settings.lr_rule == "lr 0.4 = 0.1 x 1024 / 256, warmup 3.75 epochs, global batch 1024"
    assert (settings.train_crop, settings.val_img_size) == (224, 224)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.learning_rate = 1.0
    hints = {f.name: f.type for f in dataclasses.fields(LaunchSettings)}
    assert hints["learning_rate"] == "float" and hints["global_batch"] == "int", hints


def test_the_sizes_come_from_the_flags_once():
    ramp = launch_settings(default_args(min_res=16, max_res=32, end_ramp=2, img_size=24, val_img_size=40))
    assert (ramp.train_crop, ramp.val_img_size) == (32, 40)


def test_resolve_learning_rate_is_the_settings_on_a_copy_of_the_flags():
    args = default_args(batch_size=1024, epochs=1)
    resolved = resolve_learning_rate(args, 1)
    settings = launch_settings(args, 1)
    assert args.learning_rate is None and args.lr_warmup_epochs is None, "the parsed flags are not changed"
    assert {k: getattr(resolved, k) for k in settings.as_flags()} == settings.as_flags()
    assert list(vars(resolved))[-3:] == ["lr_derived", "lr_warmup_derived", "lr_rule"], "config.json's order"


def test_the_optimizer_and_the_schedule_take_the_launch_settings_without_a_resolved_copy_of_the_flags():
    args = default_args(lr_scheduler="cosine", epochs=4, batch_size=512)  # no --learning_rate, no --lr_warmup_epochs
    settings = launch_settings(args, num_processes=2)  # global batch 1024: lr 0.4, warmup 3.75 epochs, capped at 1
    optimizer = build_optimizer(torch.nn.Linear(2, 2), args, settings)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4)
    scheduler = build_training_scheduler(optimizer, args, 10, settings)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * 0.01)  # the warmup's first step
    keywords = scheduler.lr_lambdas[0].keywords
    assert (keywords["total_steps"], keywords["warmup_steps"]) == (40, 10)
    assert scheduler.base_lrs[0] == pytest.approx(0.4)


# --- a resume: every optimisation and schedule flag is honoured or refused, never ignored ---------------------------


def test_every_optimisation_and_schedule_flag_is_declared_resumable_or_not():
    declared = set(RESUMABLE_FLAGS) | set(NOT_RESUMABLE_FLAGS)
    assert not set(RESUMABLE_FLAGS) & set(NOT_RESUMABLE_FLAGS), "declared both ways"
    flags = optimisation_flags()
    assert {"learning_rate", "momentum", "weight_decay", "lr_scheduler", "lr_warmup_epochs"} <= set(flags)
    assert set(flags) == declared, (
        f"undeclared: {set(flags) - declared}; declared but no such flag: {declared - set(flags)}"
    )


def recorded(args: argparse.Namespace, parser=None) -> dict:
    """What a checkpoint of a run with `args` records (08b's setup_run)."""
    return {flag: getattr(args, flag) for flag in optimisation_flags(parser)}


def test_a_resume_that_changes_a_resumable_flag_is_accepted():
    saved = recorded(default_args())
    check_resume_flags(saved, default_args(momentum=0.8, lr_scheduler="cosine", epochs=100, batch_size=64), "ckpt")


def test_a_resume_that_changes_a_flag_it_cannot_apply_is_refused_naming_it():
    with pytest.raises(BadFlagError) as refused:
        check_resume_flags(recorded(default_args()), default_args(zero_init_residual=True), "step_000000010")
    assert str(refused.value) == (
        "--zero_init_residual is True here but False in step_000000010: a resume cannot change it (it sets the "
        "initial weights only, which the checkpoint's replace); resume with the checkpoint's value, or start a new "
        "--experiment_name"
    )


def with_throwaway_flag() -> argparse.ArgumentParser:
    """The script's parser with one more optimizer flag, `--nesterov`, declared nowhere else."""
    parser = get_args_parser(exit_on_error=False)
    optimisation = next(g for g in parser._action_groups if g.title == "optimisation")
    optimisation.add_argument("--nesterov", action="store_true", help="Nesterov momentum")
    return parser


def test_a_new_optimizer_flag_declared_nowhere_is_refused_on_resume_not_ignored():
    parser = with_throwaway_flag()
    assert "nesterov" in optimisation_flags(parser), "a checkpoint records the new flag with the others"
    saved = recorded(parser.parse_args([]), parser)
    check_resume_flags(saved, parser.parse_args([]), "ckpt")  # unchanged: nothing to refuse
    with pytest.raises(BadFlagError, match=r"^--nesterov is True here but False in ckpt: a resume cannot change it"):
        check_resume_flags(saved, parser.parse_args(["--nesterov"]), "ckpt")


def test_a_new_optimizer_flag_declared_resumable_reaches_the_resumed_optimizer(monkeypatch):
    parser = with_throwaway_flag()
    monkeypatch.setitem(RESUMABLE_FLAGS, "nesterov", "set again on the restored optimizer's parameter groups")
    before, now = parser.parse_args([]), parser.parse_args(["--nesterov", "--momentum", "0.8"])
    check_resume_flags(recorded(before, parser), now, "ckpt")  # declared: accepted

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))

    def sgd(args):  # 08b's build_optimizer as it would read the new flag
        groups = param_groups(model, args.weight_decay, args.norm_weight_decay, args.bias_weight_decay)
        return torch.optim.SGD(
            groups, lr=launch_settings(args).learning_rate, momentum=args.momentum, nesterov=args.nesterov
        )

    resumed = sgd(now)
    resumed.load_state_dict(sgd(before).state_dict())  # what load_state does: the checkpoint's hyperparameters
    assert resumed.param_groups[0]["nesterov"] is False and resumed.param_groups[0]["momentum"] == 0.9
    assert override_hyperparameters(resumed, sgd(now).param_groups)
    assert all(g["nesterov"] is True and g["momentum"] == 0.8 for g in resumed.param_groups), "the flag is honoured"
    assert not override_hyperparameters(resumed, sgd(now).param_groups), "nothing left to change"


@pytest.mark.slow
def test_a_real_resume_that_changes_zero_init_residual_is_refused_and_one_that_changes_momentum_trains_with_it(
    tmp_path, capsys
):
    import json

    from train_helpers import TINY

    from tutorial_lib.checkpoints import MANIFEST, latest_checkpoint
    from tutorial_lib.train import train

    def run(**flags):
        options = {**TINY, "model": "resnet18", "batch_size": 16, "epochs": 1, "working_directory": str(tmp_path)}
        return train(default_args(**{**options, "experiment_name": "resumed", **flags}))

    run(stop_after_steps=2)  # a checkpoint at step 2 of 5
    checkpoint = latest_checkpoint(tmp_path / "resumed")
    assert json.loads((checkpoint / MANIFEST).read_text())["flags"]["zero_init_residual"] is False
    with pytest.raises(BadFlagError, match=r"^--zero_init_residual is True here but False in .*step_000000002"):
        run(resume_from_checkpoint="latest", zero_init_residual=True)
    assert latest_checkpoint(tmp_path / "resumed") == checkpoint, "nothing trained after the refusal"
    capsys.readouterr()
    final = run(resume_from_checkpoint="latest", momentum=0.5)
    assert final["finished"] and final["optimizer_steps"] == 5
    assert "resumed with the flags given now: lr 0.05 at step 2 of 5 of the schedule" in capsys.readouterr().out
