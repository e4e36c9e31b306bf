"""tutorial_lib.trackers: W&B's mode without the network, and an offline run read back from its files."""

from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tutorial_lib.trackers import resolve_wandb_mode, wandb_api_key_configured


@pytest.fixture
def no_wandb_config(monkeypatch, tmp_path):
    """An environment with no W&B variables and an empty home (no .netrc)."""
    for var in ["WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_BASE_URL"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-such-netrc"))
    return tmp_path


def test_resolve_wandb_mode_is_offline_without_an_api_key(no_wandb_config):
    assert not wandb_api_key_configured()
    assert resolve_wandb_mode() == "offline"


def test_resolve_wandb_mode_is_online_with_a_key_in_the_environment(no_wandb_config, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode() == "online"


def write_netrc(folder: Path, monkeypatch, *machines: str) -> None:
    netrc_file = folder / "netrc"
    netrc_file.write_text("".join(f"machine {m}\n  login user\n  password {'k' * 40}\n" for m in machines))
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))


def test_resolve_wandb_mode_is_online_with_a_netrc_entry(no_wandb_config, monkeypatch):
    write_netrc(no_wandb_config, monkeypatch, "api.wandb.ai")
    assert resolve_wandb_mode() == "online"


@pytest.mark.parametrize(
    "explicit,expected", [("disabled", "disabled"), ("offline", "offline"), ("ONLINE", "online"), ("dryrun", "offline")]
)
def test_resolve_wandb_mode_respects_an_explicit_wandb_mode(no_wandb_config, monkeypatch, explicit, expected):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # an explicit mode beats a configured key
    monkeypatch.setenv("WANDB_MODE", explicit)
    assert resolve_wandb_mode() == expected


def test_resolve_wandb_mode_refuses_an_unknown_mode(no_wandb_config, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ValueError, match="WANDB_MODE"):
        resolve_wandb_mode()


# --- an offline W&B run, written by the trackers of the training script and read back -------------------


def log_offline(run_dir: Path, first_step: int, steps: int) -> str:
    """One start of a run's logging as the training script does it (`start_trackers` with a fixed run id)."""
    from accelerate import Accelerator

    from tutorial_lib.trackers import start_trackers

    accelerator = Accelerator(cpu=True, log_with="wandb", project_dir=str(run_dir))
    mode = start_trackers(
        accelerator,
        "tests",
        config={"lr": 0.25, "model": "tinycnn"},
        run_id="offlinetest",
        name="offline",
        run_dir=run_dir,
    )
    for step in range(first_step, first_step + steps):
        accelerator.log({"loss": 1.0 / (step + 1), "epoch": step // 2}, step=step)
    accelerator.end_training()
    return mode


@pytest.mark.slow
def test_an_offline_wandb_run_and_its_resume_are_read_back_from_their_files(no_wandb_config, monkeypatch):
    from tutorial_lib.trackers import read_wandb_offline_run

    monkeypatch.setenv("WANDB_MODE", "offline")  # and no key, no .netrc: nothing can reach a server
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = no_wandb_config / "run"
    run_dir.mkdir()
    assert log_offline(run_dir, 0, 4) == "offline"
    log_offline(run_dir, 4, 3)  # the resumed run: the same run id
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2, folders
    runs = [read_wandb_offline_run(folder, timeout=30) for folder in folders]  # W&B writes them a moment later
    assert [r["run_id"] for r in runs] == ["offlinetest"] * 2 and runs[0]["project"] == "tests"
    assert all(r["finished"] for r in runs)
    assert runs[0]["config"] == {"lr": 0.25, "model": "tinycnn"}, runs[0]["config"]
    rows = [row for r in runs for row in r["history"]]
    assert [row["_step"] for row in rows] == list(range(7))
    assert [row["loss"] for row in rows] == [1.0 / (s + 1) for s in range(7)] and rows[5]["epoch"] == 2
    assert runs[0]["summary"]["loss"] == 1.0 / 4 and runs[1]["summary"]["loss"] == 1.0 / 7
    assert runs[1]["summary"]["_step"] == 6


@pytest.mark.slow
def test_reading_an_offline_wandb_run_stops_at_a_torn_record_and_refuses_other_files(
    tmp_path, no_wandb_config, monkeypatch
):
    from tutorial_lib.trackers import read_wandb_offline_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = no_wandb_config / "run"
    run_dir.mkdir()
    log_offline(run_dir, 0, 5)
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    (wandb_file,) = folder.glob("run-*.wandb")
    whole = read_wandb_offline_run(folder, timeout=30)
    assert whole["finished"]
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / wandb_file.name).write_bytes(wandb_file.read_bytes()[:-20])  # a run killed while writing
    partial = read_wandb_offline_run(torn)
    assert partial["run_id"] == "offlinetest" and not partial["finished"] and len(partial["history"]) <= 5
    assert len(whole["history"]) == 5
    (torn / wandb_file.name).write_bytes(b"not a wandb file")
    with pytest.raises(ValueError, match="not a W&B run file"):
        read_wandb_offline_run(torn)
    with pytest.raises(FileNotFoundError, match="offline-run"):
        read_wandb_offline_run(tmp_path)


# --- which server, and which saved key: what the installed wandb itself would use -------------------------


def test_a_key_wandb_login_saved_for_the_installed_wandbs_own_server_counts(no_wandb_config, monkeypatch):
    import wandb

    from tutorial_lib.trackers import wandb_server_url

    assert wandb_server_url() == wandb.Settings().base_url  # https://api.forge.coreweave.com in wandb 0.31
    write_netrc(no_wandb_config, monkeypatch, urlsplit(wandb.Settings().base_url).netloc)  # what `wandb login` writes
    assert resolve_wandb_mode() == "online"


def test_a_login_of_an_older_wandb_counts_for_coreweaves_address_but_not_for_another_server(
    no_wandb_config, monkeypatch
):
    write_netrc(no_wandb_config, monkeypatch, "api.wandb.ai")
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.forge.coreweave.com")  # wandb reads api.wandb.ai's key there
    assert wandb_api_key_configured()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")  # a server of one's own takes only its own
    assert not wandb_api_key_configured()
    write_netrc(no_wandb_config, monkeypatch, "wandb.example.org")
    assert wandb_api_key_configured()


def test_the_server_asked_whether_it_answers_is_the_one_wandb_talks_to(no_wandb_config, monkeypatch):
    import urllib.request

    import wandb

    from tutorial_lib.trackers import wandb_server_problem

    asked = []

    def answer(request, timeout):
        asked.append(request.full_url)
        raise OSError("no network here")

    monkeypatch.setattr(urllib.request, "urlopen", answer)
    assert "does not answer" in wandb_server_problem(timeout=5)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    wandb_server_problem(timeout=5)
    assert asked == [wandb.Settings().base_url, "https://wandb.example.org"]
