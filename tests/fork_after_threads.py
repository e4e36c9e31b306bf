"""Run by tests/test_core.py in a process forked from the library's fork server (`TrainingProcess(...,
module="fork_after_threads")`), which imported torch but never computed: compute on 2 OpenMP threads, then run 01's
and 02's launches (not a test module)."""

import os


def main(argv: list[str] | None = None) -> None:
    os.setsid()  # a process group of its own: the test kills it and the launched workers together if they hang
    import torch

    torch.set_num_threads(2)
    conv, x = torch.nn.Conv2d(3, 32, 3), torch.randn(16, 3, 64, 64)
    for _ in range(3):
        conv(x).sum().backward()  # this process has now computed on its 2 OpenMP threads
    from tutorial_lib.accumulation import run_accumulation_timeline
    from tutorial_lib.parallel import run_ddp_gradient_check

    run_accumulation_timeline()
    run_ddp_gradient_check()
    print("launched twice", flush=True)
