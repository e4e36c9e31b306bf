"""The structure of `tutorial_lib`, stated and checked: which module may import which, no cycle, and the data
sources' `Reader` protocol. Pure logic: the modules' source is parsed, nothing is run (the fast tier)."""

import ast
from pathlib import Path

import pytest

import tutorial_lib

LIB = Path(tutorial_lib.__file__).parent

# floor: (its modules, the floors they may import); a module may import its own floor (no cycle) and those listed
FLOORS = {
    # 00: smoke mode, the global batch, UserError and MissingPathError: imports nothing, so every module can use it
    "foundation": ({"core"}, set()),
    # the one-file script (08) is copied into a learner's project: it must run without the library
    "standalone": ({"simple_train"}, set()),
    # 00a: the command-line conventions (one-line errors, checked flag types, short paths) every command line uses
    "conventions": ({"cli"}, {"foundation"}),
    # the main path's concepts (01-05, 10): each stands on 00 alone, knows nothing of data, Accelerate or flags
    "concepts": ({"accumulation", "parallel", "precision", "optim", "schedules", "timing"}, {"foundation"}),
    # 07's data (transforms, sources, decoding, loading, preparation, benchmarks): never imports the Accelerate layer
    "data": (
        {"transforms", "sources", "decoding", "loading", "data", "databench"},
        {"foundation", "conventions"},
    ),
    # 06's family (the accelerator, checkpoints, run folders, trackers, launching): knows nothing of data or flags
    "accelerate": ({"accel", "checkpoints", "runs", "trackers", "launching"}, {"foundation"}),
    # 08a's flags and 08b's script: put every layer below together
    "script": (
        {"flags", "train"},
        {"foundation", "conventions", "concepts", "data", "accelerate"},
    ),
    # what runs, attacks and measures the script (10a, 11a, 11b): may import anything below
    "harness": (
        {"bench", "processes", "stress"},
        {"foundation", "conventions", "concepts", "data", "accelerate", "script"},
    ),
}
FLOOR_OF = {module: floor for floor, (modules, _) in FLOORS.items() for module in modules}


def library_imports(path: Path) -> set[str]:
    """The modules of `tutorial_lib` that `path` imports, at its top or inside a function (`from .x import`,
    `from tutorial_lib.x import`, `import tutorial_lib.x`); the package itself (`__version__`) is not a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 0 and (node.module or "").startswith("tutorial_lib."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("tutorial_lib.")}
    return found - {path.stem}


def modules() -> list[str]:
    return sorted(p.stem for p in LIB.glob("*.py") if not p.name.startswith("_"))


GRAPH = {module: library_imports(LIB / f"{module}.py") for module in modules()}


def test_every_module_has_exactly_one_floor():
    placed = [module for modules_, _ in FLOORS.values() for module in modules_]
    assert len(placed) == len(set(placed)), "a module on two floors"
    assert set(placed) == set(GRAPH), (
        f"not placed: {set(GRAPH) - set(placed)}; no such module: {set(placed) - set(GRAPH)}"
    )
    for floor, (_, allowed) in FLOORS.items():
        assert allowed <= set(FLOORS), (floor, allowed)


@pytest.mark.parametrize("module", modules())
def test_every_import_respects_the_floors(module):
    floor = FLOOR_OF[module]
    allowed = FLOORS[floor][1] | {floor}
    wrong = {f"{target} ({FLOOR_OF[target]})" for target in GRAPH[module] if FLOOR_OF[target] not in allowed}
    assert not wrong, f"{module} ({floor}) may import the floors {sorted(allowed)}, not {sorted(wrong)}"


def test_the_imports_have_no_cycle():
    done, path = set(), []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module in done:
            return
        path.append(module)
        for target in sorted(GRAPH[module]):
            visit(target)
        path.pop()
        done.add(module)

    for module in GRAPH:
        visit(module)


def test_the_data_modules_reach_missing_path_error_without_the_accelerate_module():
    from tutorial_lib import accel, core, sources

    assert sources.MissingPathError is core.MissingPathError is accel.MissingPathError  # 06 re-exports 00's
    assert not any("accel" in GRAPH[m] for m in FLOORS["data"][0])


# --- the data sources' Reader protocol -------------------------------------------------------------------------------


def reader_classes() -> list[type]:
    from tutorial_lib import sources

    return [v for k, v in vars(sources).items() if isinstance(v, type) and k.endswith("Reader") and k != "Reader"]


@pytest.fixture(scope="module")
def readers():
    """One of each reader class: class folders and 🤗 records, both of the embedded data."""
    from tutorial_lib.sources import FolderReader, RecordReader, embedded_data_path, read_bytes

    datasets = pytest.importorskip("datasets")
    folder = FolderReader(embedded_data_path() / "val")
    rows = [folder.samples[i] for i in range(4)]
    features = datasets.Features(image=datasets.Image(), label=datasets.ClassLabel(names=folder.classes))
    table = {"image": [{"bytes": read_bytes(p).numpy().tobytes(), "path": None} for p, _ in rows]}
    records = datasets.Dataset.from_dict({**table, "label": [t for _, t in rows]}, features=features)
    return {FolderReader: folder, RecordReader: RecordReader(records, name="records")}


def test_the_reader_protocol_names_the_nine_members_the_datasets_use():
    from tutorial_lib.sources import Reader

    members = set(Reader.__protocol_attrs__) if hasattr(Reader, "__protocol_attrs__") else None
    if members is None:  # Python < 3.12
        from typing import _get_protocol_attrs

        members = set(_get_protocol_attrs(Reader))
    assert members == {"root", "classes", "samples", "targets", "left_out", "advice", "__len__", "name", "read"}


def test_every_reader_class_is_a_reader(readers):
    from tutorial_lib.sources import Reader

    assert set(readers) == set(reader_classes()), "a reader class without an instance here"
    for cls, reader in readers.items():
        assert isinstance(reader, Reader), cls
        data, name = reader.read(0)
        assert data.dtype.is_floating_point is False and data.numel() > 0 and isinstance(reader.name(0), str), cls
        assert len(reader) == len(reader.samples) == len(reader.targets), cls
        assert isinstance(name, str) and reader.classes and reader.root, cls


def test_an_object_missing_a_member_is_not_a_reader(readers):
    from tutorial_lib.sources import FolderReader, Reader

    class NoAdvice:  # everything but `advice`
        def __init__(self, reader):
            for key in ("root", "classes", "samples", "targets", "left_out"):
                setattr(self, key, getattr(reader, key))

        def __len__(self):
            return 0

        def name(self, index):
            return ""

        def read(self, index):
            return None, ""

    assert not isinstance(NoAdvice(readers[FolderReader]), Reader)


def test_open_readers_is_typed_with_the_protocol():
    import typing

    from tutorial_lib import sources

    hints = typing.get_type_hints(sources.open_readers)
    assert hints["return"] == tuple[sources.Reader, sources.Reader]
