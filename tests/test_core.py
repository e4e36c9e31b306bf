import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_helpers import run_in_kernel, short_tmpdir

from tutorial_lib.core import (
    UserError,
    bf16_supported,
    check_free_space,
    environment_report,
    format_size,
    free_port,
    global_batch_size,
    smoke_mode,
    training_time_seconds,
)


def test_global_batch_is_the_product_of_micro_batch_accumulation_and_processes():
    assert global_batch_size(32, 4, 2) == 256
    assert global_batch_size(7) == 7


@pytest.mark.parametrize("bad", [(0, 1, 1), (8, 0, 1), (8, 1, -2), (2.5, 1, 1)])
def test_global_batch_refuses_non_positive_integers(bad):
    with pytest.raises(ValueError, match="positive integer"):
        global_batch_size(*bad)


def test_sizes_are_said_in_si_units_the_largest_one_they_reach():
    sizes = (0, 999, 31_539, 233_472, 4.6e6, 5.2e9, 3e12)
    assert [format_size(n) for n in sizes] == [
        "0 bytes",
        "999 bytes",
        "31.5 kB",
        "233.5 kB",
        "4.6 MB",
        "5.2 GB",
        "3.0 TB",
    ]
    # a progress line keeps MB as its smallest unit: the figures of a growing job stay comparable
    assert [format_size(n, smallest="MB") for n in (0, 40_000, 600_000, 4.6e6, 5.2e9)] == [
        "0.0 MB",
        "0.0 MB",
        "0.6 MB",
        "4.6 MB",
        "5.2 GB",
    ]
    with pytest.raises(ValueError, match="smallest must be one of"):
        format_size(1, smallest="KB")


def test_free_space_is_checked_on_the_disk_a_new_folder_will_be_on(tmp_path, monkeypatch):
    asked = []

    def disk_usage(path):
        asked.append(Path(path))
        return type("Usage", (), {"free": 40_000})()

    monkeypatch.setattr("shutil.disk_usage", disk_usage)

    class ShardError(UserError):
        pass

    out = tmp_path / "not" / "yet"
    check_free_space(out, 40_000, "the shards", "output folder", ShardError)  # exactly what is free: fits
    with pytest.raises(ShardError) as refused:
        check_free_space(out, 2_500_000, "the shards", "output folder", ShardError)
    assert asked == [tmp_path, tmp_path], "the nearest folder that exists is on the disk `out` will be on"
    assert str(refused.value) == (
        f"not enough space on the disk of {out} for the shards: it needs about 2.5 MB, 40.0 kB are free; "
        "free some space or choose another output folder"
    )


def test_smoke_mode_reads_the_environment_variable(monkeypatch):
    monkeypatch.setenv("TUTORIAL_SMOKE", "1")
    assert smoke_mode()
    monkeypatch.setenv("TUTORIAL_SMOKE", "0")
    assert not smoke_mode()
    monkeypatch.delenv("TUTORIAL_SMOKE")
    assert not smoke_mode()


def test_training_time_is_images_times_epochs_over_throughput():
    assert training_time_seconds(100.0, images=1000, epochs=3) == pytest.approx(30.0)
    with pytest.raises(ValueError):
        training_time_seconds(0)


def test_free_port_gives_a_bindable_port_and_never_one_that_is_in_use():
    import socket

    port = free_port()
    assert 1024 < port < 65536
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))  # free: it can be bound
        held.listen()
        others = {free_port() for _ in range(5)}  # while it is taken, free_port must give other ports
    assert port not in others


def test_environment_report_names_versions_and_devices():
    report = environment_report()
    assert report["torch"] == torch.__version__
    assert report["cuda_available"] == torch.cuda.is_available()
    assert report["bf16_supported"] == bf16_supported()


@pytest.mark.slow
def test_console_script_prints_version_and_hardware():
    exe = Path(sys.executable).with_name("tutorial-lib")
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    assert out.startswith("tutorial_lib 0.")
    assert "cuda_available" in out and "bf16_supported" in out


@pytest.mark.slow
def test_importing_the_library_does_no_work():
    # No prints and no CUDA probing at import time (notebook_launcher needs CUDA untouched).
    code = "import torch, tutorial_lib, tutorial_lib.core; assert not torch.cuda.is_initialized(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out == "ok\n"


SCRATCH_THEN_FORK = """
import os, sys
from tutorial_lib.core import scratch_dir
folder = scratch_dir("scratch-test-")
(folder / "checkpoint.bin").write_bytes(b"x" * 1000)
child = os.fork()
if child == 0:
    sys.exit(0)  # a child that exits normally runs the atexit handlers it inherited
os.waitpid(child, 0)
assert (folder / "checkpoint.bin").exists(), "a forked child deleted its parent's scratch folder"
print(folder)
"""


@pytest.mark.slow
def test_scratch_dir_is_deleted_when_its_process_exits_and_not_when_a_forked_child_does(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", SCRATCH_THEN_FORK], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    folder = Path(out.stdout.strip())
    assert folder.parent == tmp_path and folder.name.startswith("scratch-test-")
    assert not folder.exists(), "the folder outlived the process that made it"


@pytest.mark.slow
def test_a_notebook_kernel_deletes_its_scratch_folder_when_it_shuts_down():
    """What notebooks 06-11 rely on: a run under nbmake or JupyterLab leaves no checkpoints in /tmp."""
    with short_tmpdir() as tmp:
        out = run_in_kernel(
            [
                "from tutorial_lib.core import scratch_dir\n"
                "folder = scratch_dir('kernel-test-'); (folder / 'model.safetensors').write_bytes(b'x')\n"
                "print(folder)"
            ],
            tmp,
        )
        folder = Path(out[0].strip())
        assert folder.parent == tmp
        assert not folder.exists(), "the kernel exited and left its scratch folder behind"


# --- Setting up Accelerate (00 section 6): config files, launches and the state inside launched processes


def _isolated_env(tmp_path):
    """HF_HOME in tmp_path, so no test reads or writes the user's default accelerate config."""
    return {"HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}


def test_cpu_launch_config_rewrites_the_launcher_fields_as_yaml_and_keeps_the_rest(tmp_path):
    import yaml
    from accelerate.utils import write_basic_config

    from tutorial_lib.core import cpu_launch_config

    source = tmp_path / "default_config.yaml"
    write_basic_config(mixed_precision="fp16", save_location=str(source))  # what `accelerate config default` writes
    assert source.read_text().lstrip().startswith("{"), "accelerate writes its default config as JSON"
    target = tmp_path / "cpu.yaml"
    returned = cpu_launch_config(source, target, num_processes=3, main_process_port=12345)
    written = yaml.safe_load(target.read_text())
    assert written == returned
    assert written["distributed_type"] == "MULTI_GPU" and written["num_processes"] == 3
    assert written["num_machines"] == 1 and written["machine_rank"] == 0 and written["main_process_port"] == 12345
    assert written["mixed_precision"] == "fp16" and written["compute_environment"] == "LOCAL_MACHINE"
    assert not target.read_text().lstrip().startswith("{"), "the edited file should be YAML"


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_cpu_launch_config_refuses_a_non_positive_number_of_processes(tmp_path, bad):
    from tutorial_lib.core import cpu_launch_config

    (tmp_path / "c.yaml").write_text("compute_environment: LOCAL_MACHINE\n")
    with pytest.raises(ValueError, match="num_processes"):
        cpu_launch_config(tmp_path / "c.yaml", tmp_path / "out.yaml", num_processes=bad)


def test_cpu_launch_config_refuses_a_file_that_is_not_a_config(tmp_path):
    from tutorial_lib.core import cpu_launch_config

    (tmp_path / "c.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="not an accelerate config"):
        cpu_launch_config(tmp_path / "c.yaml", tmp_path / "out.yaml")


def test_read_process_states_sorts_by_process_index_and_refuses_an_empty_folder(tmp_path):
    import json

    from tutorial_lib.core import read_process_states

    with pytest.raises(FileNotFoundError, match="state-"):
        read_process_states(tmp_path)
    for pid, index in [(30, 1), (10, 0), (20, 0)]:
        (tmp_path / f"state-{pid}.json").write_text(json.dumps({"process_index": index, "pid": pid}))
    assert [(r["process_index"], r["pid"]) for r in read_process_states(tmp_path)] == [(0, 10), (0, 20), (1, 30)]


@pytest.mark.slow
def test_config_default_command_writes_the_default_file_under_hf_home(tmp_path):
    import yaml
    from accelerate.commands.config.config_args import default_config_file, hf_cache_home

    from tutorial_lib.core import accelerate_cli

    env = _isolated_env(tmp_path)
    run = accelerate_cli(["config", "default"], env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    expected = Path(env["HF_HOME"]) / Path(default_config_file).relative_to(hf_cache_home)
    assert expected.is_file() and str(expected) in run.stdout
    assert yaml.safe_load(expected.read_text())["compute_environment"] == "LOCAL_MACHINE"


@pytest.mark.slow
def test_two_launched_cpu_processes_form_one_group_and_a_flag_beats_the_config_file(tmp_path):
    from tutorial_lib.core import cpu_launch_config, launch_state_probe

    config = tmp_path / "cpu.yaml"
    (tmp_path / "base.yaml").write_text("compute_environment: LOCAL_MACHINE\nmixed_precision: 'no'\nuse_cpu: false\n")
    cpu_launch_config(tmp_path / "base.yaml", config, num_processes=2)
    states = launch_state_probe(
        config, tmp_path / "run", flags=["--mixed_precision", "bf16"], env=_isolated_env(tmp_path), timeout=240
    )
    assert [s["process_index"] for s in states] == [0, 1]
    assert all(s["num_processes"] == 2 and s["env"]["WORLD_SIZE"] == "2" for s in states)  # from the file
    assert all(s["backend"] == "gloo" and s["distributed_type"] == "MULTI_CPU" for s in states)
    assert all(s["mixed_precision"] == "bf16" for s in states)  # the flag, over the file's 'no'


@pytest.mark.slow
def test_a_failed_launch_raises_with_the_launcher_error(tmp_path):
    from tutorial_lib.core import launch_state_probe

    with pytest.raises(RuntimeError, match="does not exist"):
        launch_state_probe(tmp_path / "missing.yaml", tmp_path / "run", env=_isolated_env(tmp_path), timeout=120)


@pytest.mark.slow
def test_run_notebooks_leaves_files_alone_in_smoke_mode_and_writes_full_mode_outputs(tmp_path):
    import nbformat

    from tutorial_lib.cli import run_notebooks

    path = tmp_path / "demo.ipynb"
    nbformat.write(
        nbformat.v4.new_notebook(
            cells=[
                nbformat.v4.new_code_cell(
                    "from tutorial_lib.core import smoke_mode\nprint(f'smoke mode: {smoke_mode()}')"
                )
            ]
        ),
        path,
    )
    before = path.read_text()
    assert list(run_notebooks([path], smoke=True)) == [str(path)]
    assert path.read_text() == before, "smoke mode only checks that the notebook runs"
    assert run_notebooks([path], clean=False)[str(path)] > 0
    assert nbformat.read(path, as_version=4).cells[0].outputs[0]["text"].strip() == "smoke mode: False"


def option_help_blocks(help_text: str) -> dict[str, str]:
    """`--flag` -> its line of `--help` with the wrapped lines of its help joined (one block per option)."""
    import re

    blocks = {}
    for block in re.split(r"\n(?=  -)", help_text):
        block = " ".join(block.split())
        if block.startswith("-"):
            blocks[block.split()[0].rstrip(",")] = block
    return blocks


def test_training_script_help_prints_one_default_per_flag():
    """A flag whose default is computed says it in words, `(default: --img_size)`; argparse must not add its own
    `(default: None)` after that, and a help text must not give a second default in another form."""
    import argparse

    from tutorial_lib.flags import get_args_parser

    parser = get_args_parser()
    blocks = option_help_blocks(parser.format_help())
    options = [
        a.option_strings[-1]
        for a in parser._actions
        if a.option_strings and a.help != argparse.SUPPRESS and a.dest != "help"
    ]
    assert options and set(options) <= set(blocks), sorted(set(options) - set(blocks))
    not_once = {o: blocks[o] for o in options if blocks[o].count("default:") != 1}
    assert not not_once, f"each flag's help must give exactly one default: {not_once}"
    assert "(default: --img_size)" in blocks["--val_img_size"] and "(default: looked up" in blocks["--peak_tflops"]
    assert "(default: --lr_base x global batch" in blocks["--learning_rate"]


def test_help_formatter_keeps_a_default_said_in_words_and_adds_the_others():
    import argparse

    from tutorial_lib.cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="demo", formatter_class=HelpFormatter)
    parser.add_argument("--size", type=int, default=None, help="evaluation size (default: --train_size)")
    parser.add_argument("--epochs", type=int, default=90, help="passes over the data")
    blocks = option_help_blocks(parser.format_help())
    assert blocks["--size"].endswith("evaluation size (default: --train_size)"), blocks["--size"]
    assert blocks["--epochs"].endswith("passes over the data (default: 90)"), blocks["--epochs"]


@pytest.mark.slow
def test_launches_from_a_process_that_computed_on_several_threads_finish(tmp_path):
    """A forked worker's first multi-threaded operation waits forever once its parent has used OpenMP threads
    (GCC's libgomp keeps no threads across a fork): 01's and 02's launches run their workers through
    `fork_safe`, on one thread. Their parent is forked from the fork server, which imported torch but never computed,
    so that the threads it then computes on are known to be its own (tests/fork_after_threads.py)."""
    from tutorial_lib.processes import TrainingProcess, child_env

    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}
    proc = TrainingProcess([], tmp_path / "threads", "fork", env=env, module="fork_after_threads")
    if proc.wait(180) is None:  # both launches take seconds; the hang is forever
        os.killpg(proc.pid, 9)  # the launched workers too
        proc.wait(30)
        pytest.fail("a launched worker hung in its first multi-threaded operation")
    done = proc.result(10)
    assert done.returncode == 0 and "launched twice" in done.stdout, done.stderr[-3000:]
