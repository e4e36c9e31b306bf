"""The learner's real environment: JupyterLab in a real browser runs notebooks through its UI.

`jupyter lab` serves a copy of a course notebook on 127.0.0.1 with a token; headless Chromium, driven by
Playwright, opens it, runs every cell from the Run menu, and saves it. The saved file and the page then show
what a learner would see: every cell ran, no error, every figure drawn as an image, no widget that failed.
Skipped, with one line, where Chromium or Playwright is missing (`.ci/run` installs both)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from browser_helpers import CHROMIUM, CHROMIUM_ARGS, browser_missing

ROOT = Path(__file__).resolve().parents[1]
# Every cell in the page, not only the visible ones: JupyterLab otherwise renders a long notebook's cells lazily.
LAB_SETTINGS = {"@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"}}
PROMPTS = ".jp-NotebookPanel .jp-CodeCell .jp-InputArea-prompt"
ALL_RAN = f"""() => {{
    const prompts = [...document.querySelectorAll('{PROMPTS}')];
    const busy = document.querySelector('.jp-Notebook-ExecutionIndicator[data-status="busy"]');
    return prompts.length > 0 && !busy && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
}}"""
ANY_STARTED = f"() => [...document.querySelectorAll('{PROMPTS}')].some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))"
NOTEBOOKS = ["09_multi_gpu_training.ipynb", "13_troubleshooting.ipynb"]


pytestmark = [pytest.mark.slow, pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a free port of 127.0.0.1, serving a folder with copies of the notebooks."""
    from tutorial_lib.core import free_port

    root = tmp_path_factory.mktemp("lab")
    for name in NOTEBOOKS:
        shutil.copy(ROOT / "notebooks" / name, root / name)
    settings = root.parent / (root.name + "_settings")
    for name, values in LAB_SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), "course-test-token"
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTER_RUNTIME_DIR": str(root.parent / "rt")}
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}"]
    command += [f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0"]
    command += [f"--LabApp.workspaces_dir={root.parent / 'workspaces'}"]  # not the user's: no tab of another run
    command += ["--allow-root"] if os.geteuid() == 0 else []  # a CI container often runs as root
    log = open(root.parent / "lab.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"jupyter lab did not start: {(root.parent / 'lab.log').read_text()[-2000:]}"
                ) from None
            time.sleep(0.5)
    yield url, token, root
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
    log.close()


@pytest.fixture(scope="module")
def browser_runs(lab, request) -> dict[str, dict | str]:
    """The notebooks this session's tests name, run at once in one browser: {name: what its page showed, or why
    it did not get there}. Each notebook has its own tab, workspace and kernel, so neither run sees the other;
    their kernels work side by side instead of one after the other, and the browser starts once."""
    module = request.node.nodeid + "::"
    names = [item.callspec.params["name"] for item in request.session.items if item.nodeid.startswith(module)]
    url, token, _ = lab
    return run_in_browser(url, token, names)


def run_in_browser(url: str, token: str, names: list[str], timeout_s: float = 240) -> dict[str, dict | str]:
    """Open each notebook in JupyterLab, run every cell from the Run menu, save; what each page showed."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    results: dict[str, dict | str] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        tabs = {}
        for name in names:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page_errors: list[str] = []
            page.on("pageerror", lambda error, errors=page_errors: errors.append(str(error)))
            # a workspace of its own, reset: only this notebook open, and no layout shared with the other tab
            page.goto(f"{url}/lab/workspaces/{Path(name).stem}/tree/{name}?reset&token={token}")
            tabs[name] = page, page_errors
        for name, (page, _) in tabs.items():  # both kernels at work before either is waited for
            try:
                start_every_cell(page, url, token, name)
            except (AssertionError, PlaywrightError) as error:
                results[name] = f"{type(error).__name__}: {error}"
        for name, (page, page_errors) in tabs.items():
            if name in results:  # it did not start
                continue
            try:
                results[name] = finish_and_save(page, timeout_s) | {"page_errors": page_errors}
            except (AssertionError, PlaywrightError) as error:
                results[name] = f"{type(error).__name__}: {error}"
        browser.close()
    shut_down_kernels(url, token)
    return results


def start_every_cell(page, url: str, token: str, name: str) -> None:
    """Once the notebook's kernel is idle, Run > Run All Cells, until a cell has started."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    wait_for_idle_kernel(url, token, name)
    # On a loaded machine the page can still be wiring the kernel to the notebook when the menu is there: a
    # "Run All Cells" it ignores leaves every cell as it was. Such a click is made again.
    for attempt in range(3):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            page.wait_for_function(ANY_STARTED, timeout=30_000, polling=250)
            print(f"{name}: cells started after {attempt + 1} click(s) of Run All Cells")
            return
        except PlaywrightTimeout:
            page.keyboard.press("Escape")  # close the menu if it is still open
    raise AssertionError("three clicks of Run > Run All Cells started no cell")


def finish_and_save(page, timeout_s: float) -> dict:
    """Until every cell has run, then save: what the page shows."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    # A cell waiting or running shows [*]; done, the kernel idle and no [*] left.
    try:
        page.wait_for_function(ALL_RAN, timeout=timeout_s * 1000, polling=500)
    except PlaywrightTimeout:
        prompts = page.evaluate(f"() => [...document.querySelectorAll('{PROMPTS}')].map(p => p.textContent)")
        text = page.locator(".jp-NotebookPanel .jp-Notebook").inner_text()
        raise AssertionError(f"cells not done after {timeout_s:g} s: {' '.join(prompts)}\n{text[-3000:]}") from None
    page.keyboard.press("Control+s")
    page.locator(".jp-mod-dirty").first.wait_for(state="detached", timeout=30_000)
    return page.evaluate(
        """() => ({
            images: [...document.querySelectorAll('.jp-OutputArea-output img')].map(
                i => i.complete && i.naturalWidth > 0),
            errors: document.querySelectorAll(
                '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]').length,
            text: document.querySelector('.jp-Notebook').innerText,
        })"""
    )


def wait_for_idle_kernel(url: str, token: str, name: str, timeout_s: float = 120) -> None:
    """Until the server has started a kernel for the notebook `name` and that kernel is idle."""
    request = urllib.request.Request(f"{url}/api/sessions", headers={"Authorization": f"token {token}"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(request) as response:
            sessions = json.load(response)
        if any(s["path"].endswith(name) and s["kernel"]["execution_state"] == "idle" for s in sessions):
            return
        time.sleep(0.5)
    raise AssertionError(f"no idle kernel for {name} after {timeout_s:g} s: {sessions}")


def shut_down_kernels(url: str, token: str) -> None:
    """End the kernels the page started (a notebook's kernel outlives its closed tab)."""
    headers = {"Authorization": f"token {token}"}
    with urllib.request.urlopen(urllib.request.Request(f"{url}/api/kernels", headers=headers)) as response:
        kernels = json.load(response)
    for kernel in kernels:
        request = urllib.request.Request(f"{url}/api/kernels/{kernel['id']}", method="DELETE", headers=headers)
        urllib.request.urlopen(request).close()


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_jupyterlab_runs_every_cell_of_the_notebook_in_a_real_browser(lab, browser_runs, name):
    _, _, root = lab
    shown = browser_runs[name]
    assert isinstance(shown, dict), shown  # otherwise why the notebook did not run to the end and save
    saved = json.loads((root / name).read_text())
    code = [cell for cell in saved["cells"] if cell["cell_type"] == "code"]
    outputs = [output for cell in code for output in cell["outputs"]]
    assert all(cell["execution_count"] for cell in code), "a cell did not run"
    assert not [o for o in outputs if o["output_type"] == "error"] and shown["errors"] == 0, "an error output"
    figures = [o for o in outputs if "image/png" in o.get("data", {})]
    original = json.loads((ROOT / "notebooks" / name).read_text())
    committed_figures = sum(
        "image/png" in o.get("data", {}) for c in original["cells"] if c["cell_type"] == "code" for o in c["outputs"]
    )
    assert len(figures) == committed_figures, (len(figures), committed_figures)  # the committed full-mode run's
    assert shown["images"] == [True] * len(figures), "a figure not drawn as an image"
    assert "Error displaying widget" not in shown["text"] and "Error rendering" not in shown["text"]
    assert shown["page_errors"] == [], shown["page_errors"]
