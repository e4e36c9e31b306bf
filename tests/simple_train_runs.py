"""Runs of the one-file script (and of `tutorial-train`) for tests/test_simple_train.py, which forks them from the
library's fork server (`TrainingProcess(..., "fork", module="simple_train_runs")`, 11a): it runs this module's `main`
(not a test module).

`main(["top1", SCRIPT, JSON, OUT])`: SCRIPT's runs ("simple_train" or "tutorial-train") of the options in JSON, one
per seed of its "seeds", one after another in this process, as the test ran them in its own; their final validation
top-1 go to OUT as a JSON list. `main(["claim", PID_FILE, *FLAGS])`: `claim_and_fork`. `main(FLAGS)`: `python -m
tutorial_lib.simple_train FLAGS`, which ends with status 0 whatever its `main` returns."""

import json
from pathlib import Path


def top1(script: str, options: dict, seed: int) -> float:
    """The final validation top-1 of one run: the calls the test made in its own process."""
    from accelerate.state import AcceleratorState, GradientState

    options = {**options, "seed": seed, "experiment_name": f"{script}_{seed}"}
    try:
        if script == "simple_train":
            from tutorial_lib import simple_train
            from tutorial_lib.cli import as_flags

            return simple_train.main(as_flags(options))["val_top1"]
        from tutorial_lib.flags import default_args
        from tutorial_lib.train import train

        return train(default_args(**options, disable_progress_bar=True))["val_top1"]
    finally:  # the next run builds its Accelerator afresh
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def claim_and_fork(pid_file: Path, argv: list[str]) -> None:
    """Claim the run folder as the run of FLAGS does, fork a child that keeps the lock's file open (as a run's data
    workers do, forked while it trains), and end: the child lives on (its pid in `pid_file`) until it is killed."""
    import os
    import time

    from tutorial_lib import simple_train

    args = simple_train.get_args_parser().parse_args(argv)
    claim = simple_train.claim_folder(args, Path(args.working_directory) / args.experiment_name, args.batch_size)
    assert claim[0] is None, claim[0]
    if os.fork() == 0:
        pid_file.write_text(str(os.getpid()))
        time.sleep(300)
        os._exit(0)


def main(argv: list[str]) -> None:
    if argv[0] == "claim":
        claim_and_fork(Path(argv[1]), argv[2:])
        return
    if argv[0] != "top1":
        from tutorial_lib import simple_train

        simple_train.main(argv)
        return
    script, config, out = argv[1], json.loads(argv[2]), Path(argv[3])
    out.write_text(json.dumps([top1(script, config["options"], seed) for seed in config["seeds"]]))
