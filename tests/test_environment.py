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
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index",
                             "--no-build-isolation", "-r", str(pip_requirements(tmp_path))],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def package_index_reachable(folder: Path) -> bool:
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(folder),
                             "--quiet", "--timeout", "5", "--retries", "0", "six"],
                            capture_output=True, text=True, timeout=60)
    return result.returncode == 0


@pytest.mark.slow
def test_pip_part_of_environment_resolves_from_the_package_index(tmp_path):
    """What a new conda user gets: the same requirement resolved from the index (skipped without one)."""
    if not package_index_reachable(tmp_path / "probe"):
        pytest.skip("no package index reachable from this machine")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                             "-r", str(pip_requirements(tmp_path))],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_with_torch_in_place_no_requirement_pulls_cuda_packages():
    """A CPU-only user installs PyTorch's CPU build first (README): nothing else the project asks for, in its base
    install or its extras, may depend on NVIDIA's CUDA packages, or pip would fetch gigabytes of them anyway."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    def requirements(dist_name: str, extras: set[str]) -> list[Requirement]:
        reqs = [Requirement(r) for r in distribution(dist_name).requires or []]
        return [r for r in reqs if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras | {""})]

    seen, todo, cuda = set(), [("tutorial_lib", {"dev", "hub", "tensorboard"})], []
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
