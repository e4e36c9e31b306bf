"""environment.yml cannot be solved here (no conda channels); check everything that can be checked."""
import subprocess
import sys
from pathlib import Path

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


def test_pip_part_of_environment_resolves(tmp_path):
    # conda runs pip from the folder of environment.yml: resolve the same requirement from there.
    pip_part = next(d["pip"] for d in load_env()["dependencies"] if isinstance(d, dict))
    req = tmp_path / "requirements.txt"
    req.write_text("\n".join(line.replace('"', "") for line in pip_part) + "\n")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "-r", str(req)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
