"""environment.yml cannot be solved here (no conda channels); check everything that can be checked."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def load_env() -> dict:
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def test_environment_file_parses_and_names_the_env():
    env = load_env()
    assert env["name"] == "resnet50-accelerate"
    deps = env["dependencies"]
    assert "python=3.11" in deps and "pip" in deps


def test_environment_installs_the_project_with_dev_extra_through_pip():
    pip_part = next(d["pip"] for d in load_env()["dependencies"] if isinstance(d, dict))
    assert pip_part == ['-e ".[dev]"']


def pip_requirements(tmp_path) -> Path:
    # conda runs pip from the folder of environment.yml: resolve the same requirement from there.
    pip_part = next(d["pip"] for d in load_env()["dependencies"] if isinstance(d, dict))
    req = tmp_path / "requirements.txt"
    req.write_text("\n".join(line.replace('"', "") for line in pip_part) + "\n")
    return req


@pytest.mark.slow
def test_pip_part_of_environment_resolves_offline_against_this_environment(tmp_path):
    """Every requirement of the project and its dev extra is satisfied by what is installed: no index needed."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--no-index",
            "--no-build-isolation",
            "-r",
            str(pip_requirements(tmp_path)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_ci_resolves_the_same_pip_requirement_from_the_package_index_in_a_fresh_environment():
    """What a new conda user gets, the pip part resolved from the index, is what `.ci/run` installs from the same
    folder into a new virtual environment before the tests: that install is this claim's runner (a resolve here
    as well would read the whole index a second time, about 40 CPU-s)."""
    pip_part = next(d["pip"] for d in load_env()["dependencies"] if isinstance(d, dict))
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    steps = [line for line in lines if line and not line.startswith("#")]
    assert 'cd "$(dirname "$0")/.."' in steps, "CI installs from the repository's root, as conda does"
    fresh = steps.index("rm -rf .venv")
    install = next(i for i, line in enumerate(steps) if " pip install " in f" {line} ")
    assert fresh < install and "python3 -m venv" in steps[install], steps[install]
    command = steps[install].split("pip install", 1)[1].split()
    assert [a for a in command if not a.startswith("-") or a == "-e"] == [
        token for line in pip_part for token in line.split()
    ], (command, pip_part)
    assert not {"--no-index", "--no-deps"} & set(command), "the install must resolve every requirement from the index"


def test_with_torch_in_place_no_requirement_pulls_cuda_packages():
    """A CPU-only user installs PyTorch's CPU build first (README): nothing else the project asks for, in its base
    install or its extras, may depend on NVIDIA's CUDA packages, or pip would fetch gigabytes of them anyway."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    def requirements(dist_name: str, extras: set[str]) -> list[Requirement]:
        reqs = [Requirement(r) for r in distribution(dist_name).requires or []]
        return [r for r in reqs if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras | {""})]

    seen, todo, cuda = set(), [("tutorial_lib", {"course", "dev", "hub", "tensorboard"})], []
    while todo:
        name, extras = todo.pop()
        try:
            reqs = requirements(name, extras)
        except PackageNotFoundError:  # an optional dependency of a dependency, not installed here
            continue
        for req in reqs:
            key = req.name.lower().replace("_", "-")
            if key in ("torch", "torchvision", "torchaudio") or key in seen:
                continue  # torch is the one the user installed for the CPU; what it needs is its own business
            seen.add(key)
            if key.startswith(("nvidia-", "cuda-", "triton")):
                cuda.append(f"{req} (needed by {name})")
                continue
            todo.append((req.name, set(req.extras)))
    assert len(seen) > 20, "the walk should reach the project's dependencies"
    assert not cuda, f"these would pull CUDA: {cuda}"


# --- the library is self-contained: every path it names is inside the repository ---------------------------


def library_strings() -> list[tuple[str, int, str]]:
    """(module, line, text) of every string literal in the library's modules, docstrings included."""
    import ast

    found = []
    for module in sorted((ROOT / "tutorial_lib").glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append((module.name, node.lineno, node.value))
    return found


def names_a_path_outside(text: str) -> bool:
    """A relative path that climbs out of where it starts (`../x`), or the shared folder beside a checkout."""
    import re

    return bool(re.search(r"(^|[\s`'\"(=])\.\./", text) or re.search(r"(^|/)shared/data\b", text))


def command_line_defaults() -> dict[str, object]:
    """`prog --flag` -> default, for every flag of every command line the library ships (subcommands included)."""
    import argparse

    from tutorial_lib import bench, data, databench, flags, stress

    parsers = [
        flags.get_args_parser(),
        bench.get_args_parser(),
        stress.get_args_parser(),
        data.get_args_parser(),
        databench.get_args_parser(),
    ]
    defaults = {}
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
            elif action.option_strings and action.default not in (None, argparse.SUPPRESS):
                defaults[f"{parser.prog} {action.option_strings[-1]}"] = action.default
    return defaults


def test_the_outside_path_check_finds_what_it_should():
    assert names_a_path_outside("../shared/data/imagenet-sample-100") and names_a_path_outside('Path("../data")')
    assert names_a_path_outside("/work/shared/data/imagenet")
    assert not names_a_path_outside("tutorial_lib/assets/cifar10_small") and not names_a_path_outside("a/b/../c is odd")
    assert not names_a_path_outside("ILSVRC/imagenet-1k") and not names_a_path_outside("sharded/data")


def test_the_library_names_no_path_outside_the_repository():
    """A default such as `../shared/data/...` works only where the course was written: the library names paths
    inside the repository or the package, and every path-valued default of its command lines resolves there."""
    import tutorial_lib

    outside = [(module, line, text[:80]) for module, line, text in library_strings() if names_a_path_outside(text)]
    assert not outside, f"paths outside the repository in the library: {outside}"
    package = Path(tutorial_lib.__file__).resolve().parent
    defaults = {
        flag: value for flag, value in command_line_defaults().items() if isinstance(value, str) and "/" in value
    }
    assert any("--data_dir" in flag for flag in defaults), "bench gpu's --data_dir default is a path"
    for flag, value in defaults.items():
        resolved = (ROOT / value).resolve()
        assert resolved.is_relative_to(ROOT) or resolved.is_relative_to(package), f"{flag} defaults to {value}, outside"
        assert resolved.exists(), f"{flag} defaults to {value}, which does not exist in a fresh clone"
