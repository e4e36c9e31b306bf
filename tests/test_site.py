"""The course as a website: `mkdocs build --strict` (mkdocs.yml, website/hooks.py), then every page in a real browser.

The build runs from a temporary folder into a temporary folder, so it starts from nothing (no cache, no site/ of an
earlier run). Strict mode fails on a missing page, file or anchor. Headless Chromium, driven by Playwright, then
opens every page from a local HTTP server with every request outside it refused: no console error, every image
drawn (natural width > 0), every internal link and #anchor found, and the search finds what a learner types.
The browser part is skipped, with one line, where Chromium or Playwright is missing (`.ci/run` installs both).
`-rP` shows the figures it prints (pages, images, links, anchors, build seconds)."""

import asyncio
import html
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlsplit

import pytest
from browser_helpers import CHROMIUM, CHROMIUM_ARGS, browser_missing

ROOT = Path(__file__).resolve().parents[1]
# what a learner types, and the page that must come up among the first results
SEARCHES = {
    "gradient accumulation": "notebooks/01_gradient_accumulation/",
    "address already in use": "notebooks/13_troubleshooting/",
}
FIRST_RESULTS = 5
TABS = 3  # pages open at once in the browser
ID = re.compile(r'\s(?:id|name)="([^"]*)"')
REMOTE = re.compile(r'<(?:script|link|img)[^>]+(?:src|href)="(?:https?:)?//[^"]+"')  # loaded from elsewhere


def mkdocs_build(config: Path, site: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`mkdocs build --strict`, run in `cwd` (where mkdocs-jupyter keeps its cache), writing `site`."""
    environ = {k: v for k, v in os.environ.items() if k != "COURSE_REPO_URL"}
    environ |= {"NO_MKDOCS_2_WARNING": "1", **env}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)]
    return subprocess.run(command, cwd=cwd, env=environ, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built from the working tree as it is, and the seconds the build took."""
    work = tmp_path_factory.mktemp("site")
    start = time.monotonic()
    result = mkdocs_build(ROOT / "mkdocs.yml", work / "site", cwd=work)
    seconds = time.monotonic() - start
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-4000:]}"
    return work / "site", seconds


def page_sources() -> dict[str, Path]:
    """{page folder on the site: its source} for every page the site must hold."""
    hooks = load_hooks()
    pages = {"": ROOT / "README.md"}
    for path in hooks.course_notebooks() + hooks.solution_notebooks():
        pages[path.relative_to(ROOT).with_suffix("").as_posix() + "/"] = path
    for path in hooks.docs_pages():
        pages[path.relative_to(ROOT).with_suffix("").as_posix() + "/"] = path
    return pages


def load_hooks():
    spec = importlib.util.spec_from_file_location("course_site_hooks", ROOT / "website" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_site_builds_in_strict_mode_with_every_notebook_and_page(site):
    root, seconds = site
    pages = page_sources()
    missing = [f"{folder}index.html ({src.relative_to(ROOT)})" for folder, src in pages.items()]
    missing = [m for m in missing if not (root / m.split(" ")[0]).is_file()]
    assert not missing, f"pages missing from the site: {missing}"
    downloads = [f for f, src in pages.items() if src.suffix == ".ipynb" and not (root / f / src.name).is_file()]
    assert not downloads, f"notebooks without their .ipynb to download: {downloads}"
    unfolded = []
    for folder, src in pages.items():
        if src.suffix == ".ipynb":
            cells = json.loads(src.read_text(encoding="utf-8"))["cells"]
            hidden = sum(1 for c in cells if c.get("metadata", {}).get("jupyter", {}).get("source_hidden"))
            folded = (root / folder / "index.html").read_text(encoding="utf-8").count('<details class="course-hidden')
            if folded != hidden:
                unfolded.append(f"{folder}: {folded} of {hidden} collapsed cells folded")
    assert not unfolded, "collapsed cells shown open on the site:\n" + "\n".join(unfolded)
    html_pages = sorted(root.glob("**/*.html"))
    remote = []
    for path in html_pages:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(root)
        remote += [f"{name}: {m}" for m in REMOTE.findall(text)]
        assert "colab.research.google.com" not in text, f"{name}: a Colab link while repo_url is unset"
    assert not remote, "pages that would load something from the internet:\n" + "\n".join(remote[:20])
    print(f"\nsite: {len(pages)} pages from the repository ({len(html_pages)} HTML files), built in {seconds:.0f} s")


def test_open_in_colab_kaggle_and_binder_come_from_the_one_repository_setting():
    pytest.importorskip("mkdocs")
    hooks = load_hooks()
    notebook = ROOT / "notebooks" / "01_gradient_accumulation.ipynb"
    unset = SimpleNamespace(repo_url=None, extra={})
    assert hooks.launch_links(unset, notebook) == []
    assert hooks.repository_url(unset, ROOT / "tests") is None
    github = SimpleNamespace(repo_url="https://github.com/someone/course", extra={})
    links = dict(hooks.launch_links(github, notebook))
    path = "notebooks/01_gradient_accumulation.ipynb"
    assert links == {
        "Open in Colab": f"https://colab.research.google.com/github/someone/course/blob/main/{path}",
        "Open in Kaggle": f"https://kaggle.com/kernels/welcome?src=https://github.com/someone/course/blob/main/{path}",
        "Open in Binder": f"https://mybinder.org/v2/gh/someone/course/main?labpath={path}",
    }
    assert hooks.repository_url(github, ROOT / "tests") == "https://github.com/someone/course/tree/main/tests"
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="GitHub"):
        hooks.on_config(SimpleNamespace(repo_url="https://example.org/course", nav=None))


@pytest.mark.slow
def test_strict_build_fails_on_a_missing_notebook_anchor_or_page(tmp_path):
    """A copy of the site's configuration over a two-page course with broken links: the build must refuse it."""
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "website").mkdir()
    (repo / "website" / "assets").mkdir()
    (repo / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text())
    (repo / "website" / "hooks.py").write_text((ROOT / "website" / "hooks.py").read_text())
    (repo / "website" / "assets" / "course.css").write_text("")
    (repo / "README.md").write_text("# Home\n\n[ok](notebooks/00_intro.ipynb#2.-Second-part)\n")

    def notebook(*markdown: str) -> str:
        cells = [{"cell_type": "markdown", "id": f"c{i}", "metadata": {}, "source": s} for i, s in enumerate(markdown)]
        meta = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
        return json.dumps({"cells": cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5})

    (repo / "notebooks" / "00_intro.ipynb").write_text(
        notebook("# 00 · Intro", "## 2. Second part\n\nSee [01](01_next.ipynb#No-such-heading).")
    )
    (repo / "notebooks" / "01_next.ipynb").write_text(notebook("# 01 · Next", "[gone](02_gone.ipynb)"))
    result = mkdocs_build(repo / "mkdocs.yml", tmp_path / "site", cwd=tmp_path)
    assert result.returncode != 0, "a strict build accepted broken links"
    assert "'01_next.ipynb#No-such-heading'" in result.stderr, result.stderr[-3000:]
    assert "'02_gone.ipynb'" in result.stderr, result.stderr[-3000:]
    assert "2.-Second-part" not in result.stderr, "the README's link to an existing JupyterLab anchor was refused"


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would bury the figures
        pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # the browser left the page while a file was on its way
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def served_site(site):
    root, _ = site
    server = _Server(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def anchors_of(file: Path, cache: dict) -> set[str]:
    if file not in cache:
        cache[file] = {html.unescape(a) for a in ID.findall(file.read_text(encoding="utf-8"))}
    return cache[file]


PAGE_FOUND = """() => ({
    images: [...document.images].map(i => [i.getAttribute('src').slice(0, 80), i.complete && i.naturalWidth > 0]),
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
})"""


async def browse(base: str, pages: list[str]) -> tuple[dict[str, dict], list[str], set[str], dict[str, list[str]]]:
    """Every page opened in Chromium, TABS at a time, then a check cell clicked and the searches typed: what each
    page holds, the problems seen, the requests that went outside the site, the first results of each search."""
    from playwright.async_api import async_playwright

    found: dict[str, dict] = {}
    problems: list[str] = []
    outside: set[str] = set()
    results: dict[str, list[str]] = {}
    with socket.socket() as refuser:  # bound, never listening: a connection to it is refused at once
        refuser.bind(("127.0.0.1", 0))
        # Every request but the local site's goes to this proxy, which refuses it: nothing intercepts the site's own
        # requests on their way, and each request is still seen (and listed) when the page makes it.
        proxy = {"server": f"http://127.0.0.1:{refuser.getsockname()[1]}", "bypass": "127.0.0.1"}
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, proxy=proxy)
            context = await browser.new_context(viewport={"width": 1400, "height": 1000})
            context.set_default_timeout(120_000)  # a loaded machine, TABS pages at once: slow, not broken
            local = (base, "data:", "blob:")
            context.on("request", lambda request: request.url.startswith(local) or outside.add(request.url))
            # Every page's search worker fetches the site-wide index and builds it (about a quarter of the pages'
            # CPU): while the pages load, the index comes with its configuration but no documents; the searches
            # below load the real one.
            empty_index: dict = {}

            async def without_documents(route):
                if not empty_index:
                    index = await (await route.fetch()).json()
                    empty_index.update(config=index["config"], docs=[])
                await route.fulfill(json=empty_index)

            await context.route(base + "search/search_index.json", without_documents)
            todo = list(reversed(pages))

            async def open_pages():
                page = await context.new_page()
                current = {"name": ""}
                page.on(
                    "console", lambda m: m.type == "error" and problems.append(f"{current['name']}: console: {m.text}")
                )
                page.on("pageerror", lambda e: problems.append(f"{current['name']}: page error: {e}"))
                while todo:
                    current["name"] = name = todo.pop()
                    await page.goto(base + name, wait_until="load")
                    found[name] = await page.evaluate(PAGE_FOUND)
                return page, current

            # pages side by side: each load also waits on the server and on the browser's other processes
            (page, current), *_ = await asyncio.gather(*(open_pages() for _ in range(TABS)))
            await context.unroute(base + "search/search_index.json", without_documents)
            # a check cell: its code folded, one click shows it
            current["name"] = "notebooks/01_gradient_accumulation/"
            await page.goto(base + current["name"], wait_until="load")
            check = page.locator("details.course-hidden-input").first
            code = check.locator(".jp-InputArea")
            if await code.is_visible():
                problems.append("01: a check cell's code is shown before a click")
            await check.locator("summary").click()
            if not await code.is_visible():
                problems.append("01: a click on a check cell's summary does not show its code")
            # every search a learner would make, typed into the search box
            for query, expected in SEARCHES.items():
                current["name"] = f"search {query!r}"
                await page.goto(base, wait_until="load")
                await page.fill("input.md-search__input", query)
                await page.wait_for_selector(".md-search-result__item", timeout=60_000)
                hrefs = await page.eval_on_selector_all(".md-search-result__item > a", "els => els.map(a => a.href)")
                results[query] = hrefs[:FIRST_RESULTS]
                if not any(h.startswith(base + expected) for h in hrefs[:FIRST_RESULTS]):
                    problems.append(f"search {query!r}: {expected} not among the first results: {results[query]}")
            await browser.close()
    return found, problems, outside, results


@pytest.mark.slow
@pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))
def test_every_page_loads_offline_with_its_images_links_and_anchors_and_search_finds_the_notebooks(site, served_site):
    root, build_seconds = site
    base = served_site
    pages = sorted(p.relative_to(root).as_posix() for p in root.glob("**/index.html"))
    start = time.monotonic()
    found, problems, external_requests, results = asyncio.run(browse(base, pages))
    browse_seconds = time.monotonic() - start
    images = links_seen = 0
    internal: dict[str, set[str]] = {}  # target URL without its #anchor: the pages linking to it
    for name in pages:
        images += len(found[name]["images"])
        problems += [f"{name}: image not drawn: {src}" for src, ok in found[name]["images"] if not ok]
        for link in found[name]["links"]:
            links_seen += 1
            if link.startswith(base):
                internal.setdefault(link, set()).add(name)
    # every internal link: its file on the site, and its #anchor among that page's ids
    cache: dict = {}
    targets = anchors = 0
    for link, sources in sorted(internal.items()):
        path, _, anchor = link[len(base) :].partition("#")
        path = unquote(urlsplit(path).path)
        file = root / path
        if path == "" or path.endswith("/"):
            file = file / "index.html"
        targets += 1
        where = f"{sorted(sources)[0]} (and {len(sources) - 1} more)" if len(sources) > 1 else next(iter(sources))
        if not file.is_file():
            problems.append(f"{where}: link to a missing file: {link}")
        elif anchor and file.suffix == ".html":
            anchors += 1
            if unquote(anchor) not in anchors_of(file, cache):
                problems.append(f"{where}: no anchor #{anchor} in {path or 'index'}")
    problems += [f"a request outside the site: {u}" for u in sorted(external_requests)]
    print(
        f"\nsite: {len(pages)} pages opened in Chromium in {browse_seconds:.0f} s (build {build_seconds:.0f} s); "
        f"{images} images drawn; {links_seen} links, {len(internal)} distinct internal targets checked, "
        f"{anchors} of them #anchors; searches: "
        + "; ".join(f"{q!r} -> {[h[len(base) :] for h in r[:2]]}" for q, r in results.items())
    )
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:40])
