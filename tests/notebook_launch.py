"""A notebook's launch of the training in a process of its own, for tests/test_launch_signals.py (not a test module).

The test forks it from the library's fork server (`TrainingProcess(..., module="notebook_launch")`), which has
imported torch and the library as a notebook's kernel has; it calls `launch_with_timeout` on `train` as a notebook
cell does. Arguments: the training's options as JSON, the number of processes."""

import json
import os


def run(options: dict) -> None:
    from tutorial_lib.flags import default_args
    from tutorial_lib.train import train

    final = train(default_args(**options))
    if final["exit_status"]:
        raise SystemExit(final["exit_status"])


def main(argv: list[str]) -> None:
    os.setsid()  # a session of its own, as a terminal's: a Ctrl-C to its group reaches it and its workers only
    from tutorial_lib.launching import launch_with_timeout

    try:
        launch_with_timeout(run, (json.loads(argv[0]),), num_processes=int(argv[1]))
    except KeyboardInterrupt:  # a notebook shows it as an interrupted cell
        print("KeyboardInterrupt from launch_with_timeout", flush=True)
        raise SystemExit(130) from None
