"""Loader workers' own memory over an epoch of an ImageNet-sized tree (07d §4). Not a test: a benchmark to run by hand.

    python tests/bench_worker_memory.py tree OUT --jpeg FILE   # 1,281,167 training files in 1,000 class folders
    python tests/bench_worker_memory.py measure OUT/           # the course's loaders: 2 workers, batch 1,024, 32 px
    python tests/bench_worker_memory.py measure OUT/ --loader torchvision   # torchvision's ImageFolder beside them

`tree` fills the folders with hard links to one copy of FILE per class (a file takes at most 65,000 links), so the
tree costs directory entries, not image data. `measure` prints one JSON line: the scan's seconds, the seconds from
start to the first batch, and each worker's unique memory (USS, Linux's /proc/<pid>/smaps_rollup) after step 1, 60,
every 100 and the last. Run it with PYTHONPATH set to another checkout of the course to measure that version's
loaders."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

IMAGENET_TRAIN = 1_281_167


def make_tree(out: Path, jpeg: Path, files: int = IMAGENET_TRAIN, classes: int = 1000) -> None:
    data = jpeg.read_bytes()
    for c in range(classes):
        folder = out / "train" / f"n{c:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        first = folder / f"n{c:08d}_0.JPEG"
        if not first.exists():
            first.write_bytes(data)
        for i in range(1, files // classes + (c < files % classes)):
            link = folder / f"n{c:08d}_{i}.JPEG"
            if not link.exists():
                os.link(first, link)
        val = out / "val" / f"n{c:08d}"
        val.mkdir(parents=True, exist_ok=True)
        (val / "v0.JPEG").write_bytes(data)


def unique_memory_mb(pid: int) -> float:  # loading.unique_memory_mb, kept here: older checkouts lack it
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    fields = ("Private_Clean:", "Private_Dirty:")
    return sum(int(line.split()[1]) for line in text.splitlines() if line.startswith(fields)) / 1024


def measure(root: Path, loader_kind: str, steps: int | None) -> dict:
    start = time.perf_counter()
    import torch

    if loader_kind == "ours":
        from tutorial_lib.loading import build_datasets, build_loaders

        train, val = build_datasets(root, img_size=32)
        loader, _ = build_loaders(train, val, batch_size=1024, num_workers=2, seed=0)
    else:
        import torchvision
        from torchvision.transforms import v2

        transform = v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(32, antialias=True), v2.RandomHorizontalFlip()])
        train = torchvision.datasets.ImageFolder(root / "train", transform=transform)
        loader = torch.utils.data.DataLoader(
            train, batch_size=1024, num_workers=2, shuffle=True, drop_last=True, persistent_workers=True
        )
    scan_s = time.perf_counter() - start
    batches = iter(loader)
    workers = [w.pid for w in batches._workers]
    steps = len(loader) if steps is None else min(steps, len(loader))
    rows, epoch_start = [], time.perf_counter()
    for step in range(1, steps + 1):
        next(batches)
        if step == 1:
            first_batch_s = time.perf_counter() - start
        if step in (1, 60) or step % 100 == 0 or step == steps:
            rows.append((step, [round(unique_memory_mb(pid), 1) for pid in workers]))
    at = dict(rows)
    return {
        "loader": loader_kind,
        "samples": len(train),
        "scan_s": round(scan_s, 2),
        "first_batch_after_start_s": round(first_batch_s, 2),
        "epoch_s": round(time.perf_counter() - epoch_start, 1),
        "steps": steps,
        "uss_mb_after_60_steps": at.get(60),
        "uss_mb_at_the_end": rows[-1][1],
        "uss_mb_peak": [max(r[1][k] for r in rows) for k in range(len(workers))],
        "uss_mb_by_step": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tree = sub.add_parser("tree", help="make the tree of links")
    tree.add_argument("out", type=Path)
    tree.add_argument("--jpeg", type=Path, required=True, help="a small real JPEG")
    run = sub.add_parser("measure", help="one epoch of the loaders")
    run.add_argument("root", type=Path)
    run.add_argument("--loader", choices=["ours", "torchvision"], default="ours")
    run.add_argument("--steps", type=int, default=None, help="stop after this many batches (default: the epoch)")
    args = parser.parse_args()
    if args.command == "tree":
        make_tree(args.out, args.jpeg)
    else:
        print(json.dumps(measure(args.root, args.loader, args.steps)))


if __name__ == "__main__":
    main()
