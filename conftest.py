"""Test-session settings shared by unit tests and notebooks (nbmake kernels inherit this env)."""
import os

# Notebooks and tests run in smoke mode: same code path, small sizes.
os.environ.setdefault("TUTORIAL_SMOKE", "1")
# Never block on W&B credentials or the network in tests.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
# Headless plotting.
os.environ.setdefault("MPLBACKEND", "Agg")
# Two cores: keep each process (and each xdist worker) from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
