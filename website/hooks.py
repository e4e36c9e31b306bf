"""MkDocs hooks that turn the repository, as it is, into the course's website (see mkdocs.yml).

Nothing is copied into the working tree: the pages are read from where they live.

- `README.md` is the home page, `docs/*.md` and `CONTRIBUTING.md` keep their paths, every notebook in `notebooks/`
  and `notebooks/solutions/` is a page (rendered from its committed outputs by mkdocs-jupyter, never executed), so
  the relative links written for GitHub and JupyterLab (`notebooks/00_introduction.ipynb`, `docs/imagenet.md`,
  `08_training_script.ipynb#From-one-file-to-tutorial-train`) resolve on the site as they are.
- The navigation: the main path in order, each deep dive under its chapter, the solutions, the reference pages.
- Headings keep JupyterLab's ids (the heading's text, spaces replaced by "-"); a Markdown page's headings answer to
  both that form and GitHub's. Links between notebooks are checked like MkDocs checks a Markdown page's links, so
  `mkdocs build --strict` fails on a missing page or anchor anywhere.
- A collapsed cell (metadata `jupyter.source_hidden`, e.g. a check cell) shows its output, its code folded in an
  expandable block.
- Each notebook page links its .ipynb for download and, only when `repo_url` is set in mkdocs.yml (or the
  `COURSE_REPO_URL` environment variable), opens it in Colab, Kaggle and Binder.
- Math becomes MathML at build time (latex2mathml): the pages need no script and no network to show it.
"""

from __future__ import annotations

import html
import json
import logging
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from bs4 import BeautifulSoup
from latex2mathml.converter import convert as latex_to_mathml
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page, _RelativePathTreeprocessor
from mkdocs.structure.toc import get_toc

log = logging.getLogger("mkdocs.hooks.course")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
HOME = "README.md"  # served as index.md
EXTRA_PAGES = ["CONTRIBUTING.md"]  # top-level Markdown pages besides the README, where they exist
NOTEBOOK_NAME = re.compile(r"^(\d\d)([a-z]?)_.*\.ipynb$")
LINK = re.compile(r"\]\(([^)\s]+)\)")  # a Markdown link's target
HTML_LINK = re.compile(r"(?:href|src)=\"([^\"]+)\"")
SKIP_DIRS = {".git", ".venv", "venv", "site", "node_modules"}
GITHUB = re.compile(r"^https?://github\.com/([^/\s]+)/([^/\s]+?)(?:\.git)?/?$")
HIDDEN_SUMMARY = {"check": "Show the check's code", "figure": "Show the code that draws the figure"}


# --- which files are pages -------------------------------------------------------------------------------------------


def course_notebooks() -> list[Path]:
    """The main path and its deep dives (NN_slug.ipynb, NNa_slug.ipynb), in the order they sort: the course's."""
    return sorted(p for p in NOTEBOOKS.glob("*.ipynb") if NOTEBOOK_NAME.match(p.name))


def solution_notebooks() -> list[Path]:
    return sorted(p for p in (NOTEBOOKS / "solutions").glob("*.ipynb") if NOTEBOOK_NAME.match(p.name))


def docs_pages() -> list[Path]:
    return sorted((ROOT / "docs").glob("**/*.md")) + [ROOT / n for n in EXTRA_PAGES if (ROOT / n).is_file()]


def src_uri(path: Path) -> str:
    """The page's path on the site's source side: the repository path, except the README, which is the home page."""
    rel = path.relative_to(ROOT).as_posix()
    return "index.md" if rel == HOME else rel


def notebook_title(path: Path) -> str:
    """The notebook's first level-1 heading, as the sidebar shows it."""
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return re.sub(r"[`*]", "", line[2:]).strip()
    return path.stem


def build_nav() -> list:
    """Home; the course (each chapter with deep dives as a section holding the chapter, then its deep dives);
    the solutions; the reference pages."""
    chapters: dict[str, list[Path]] = {}
    for path in course_notebooks():
        chapters.setdefault(NOTEBOOK_NAME.match(path.name).group(1), []).append(path)
    course = []
    for paths in chapters.values():
        entries = [{notebook_title(p): src_uri(p)} for p in paths]
        course.append({notebook_title(paths[0]): entries} if len(paths) > 1 else entries[0])
    nav: list = [{"Home": "index.md"}, {"Course": course}]
    solutions = [{notebook_title(p): src_uri(p)} for p in solution_notebooks()]
    if solutions:
        nav.append({"Solutions": solutions})
    reference = [src_uri(p) for p in docs_pages()]
    if reference:
        nav.append({"Reference": reference})
    return nav


def linked_repository_files() -> set[Path]:
    """Files of the repository that a page links to but that are not pages (a script, a config, an image): they are
    copied into the site so that the link works there too."""
    sources = [ROOT / HOME, *docs_pages()]
    found = set()
    for page in sources + course_notebooks() + solution_notebooks():
        if not page.is_file():
            continue
        if page.suffix == ".ipynb":
            cells = json.loads(page.read_text(encoding="utf-8"))["cells"]
            text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        else:
            text = page.read_text(encoding="utf-8")
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for link in LINK.findall(text) + HTML_LINK.findall(text):
            target = repository_target(page, link)
            if target is not None and target.is_file() and target.suffix not in (".md", ".ipynb"):
                found.add(target)
    return found


def repository_target(page: Path, link: str) -> Path | None:
    """The file or folder of the repository that a relative link in `page` (a path in the repository) points to."""
    parts = urlsplit(link)
    if parts.scheme or parts.netloc or not parts.path or link.startswith(("/", "#")):
        return None
    target = (page.parent / unquote(parts.path)).resolve()
    try:
        rel = target.relative_to(ROOT)
    except ValueError:
        return None
    if rel.parts and rel.parts[0] in SKIP_DIRS:
        return None
    return target if target.exists() else None


# --- MkDocs events ---------------------------------------------------------------------------------------------------


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    config.nav = build_nav()
    repo = config.repo_url
    if repo and not GITHUB.match(repo):
        raise PluginError(
            f"repo_url {repo!r}: Colab, Kaggle and Binder open notebooks from GitHub; "
            "set it to https://github.com/<owner>/<name>, or leave it unset for a site without those links"
        )
    return config


@event_priority(100)  # before mkdocs-jupyter, which turns the notebooks added here into pages
def on_files(files: Files, config: MkDocsConfig) -> Files:
    pages = [ROOT / HOME, *docs_pages(), *course_notebooks(), *solution_notebooks()]
    for path in pages + sorted(linked_repository_files()):
        uri = src_uri(path)
        if files.get_file_from_path(uri) is not None:
            raise PluginError(f"{uri} exists both in {config.docs_dir} and in the repository")
        if uri == path.relative_to(ROOT).as_posix():  # a file read from the repository (mkdocs-jupyter needs these)
            files.append(
                File(uri, src_dir=str(ROOT), dest_dir=config.site_dir, use_directory_urls=config.use_directory_urls)
            )
        else:
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_serve(server, config: MkDocsConfig, builder):
    """`mkdocs serve` rebuilds when a page changes where it lives (MkDocs itself watches only docs_dir)."""
    for path in [ROOT / HOME, ROOT / "docs", NOTEBOOKS, *(ROOT / n for n in EXTRA_PAGES)]:
        if path.exists():
            server.watch(str(path))
    return server


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """A link to a folder of the repository (tests/, tutorial_lib/) goes to that folder on GitHub, or becomes plain
    text while repo_url is unset: the site holds files, not folders."""
    source = source_path(page)

    def folder_link(match: re.Match) -> str:
        target = repository_target(source, match.group(2))
        if target is None or not target.is_dir():
            return match.group(0)
        url = repository_url(config, target)
        return f"[{match.group(1)}]({url})" if url else match.group(1)

    parts = re.split(r"(```.*?```)", markdown, flags=re.S)
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"\[([^\]]*)\]\(([^)\s]+)\)", folder_link, parts[i])
    return "".join(parts)


def on_page_content(content: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri.endswith(".ipynb"):
        return notebook_page(content, page, config, files)
    soup = BeautifulSoup(content, "html.parser")
    for element in soup.select(".arithmatex"):
        tex = element.get_text().strip()
        tex = tex[2:-2] if tex[:2] in ("\\(", "\\[") else tex
        element.replace_with(BeautifulSoup(mathml(tex, element.name == "div"), "html.parser"))
    for heading in soup.find_all(re.compile(r"^h[1-6]$")):
        alias = jupyterlab_id(heading_text(str(heading)))
        if heading.get("id") and alias and alias != heading["id"]:  # GitHub's id, and JupyterLab's as well
            heading.insert(0, soup.new_tag("a", attrs={"id": alias}))
            page.present_anchor_ids = (page.present_anchor_ids or set()) | {alias}
    return str(soup)


def on_post_build(config: MkDocsConfig) -> None:
    """One style sheet for every notebook page, instead of the 600 kB that nbconvert puts in each."""
    out = Path(config.site_dir) / NOTEBOOK_CSS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(NOTEBOOK_STYLES), encoding="utf-8")


# --- notebook pages --------------------------------------------------------------------------------------------------
# nbconvert's HTML is regular (one <div class="jp-Cell ..."> per cell, headings on one pattern), and a notebook page
# with its outputs holds about 100,000 tags: the pages are edited as text, which takes milliseconds.

NOTEBOOK_CSS = "assets/notebook.css"  # listed in extra_css (mkdocs.yml), written by on_post_build
NOTEBOOK_STYLES: dict[str, None] = {}  # each distinct <style> of the notebook pages, in the order met
STYLE = re.compile(r"<style[^>]*>(.*?)</style>", re.S)
# nbconvert's page brings MathJax, Mermaid and the widgets' renderer from CDNs: the math is MathML here, there are no
# diagrams, and a widget (a progress bar) shows nothing rather than ask the network
REMOTE_SCRIPT = re.compile(
    r'<script[^>]*(?:\ssrc=|type="text/x-mathjax-config"|type="module")[^>]*>.*?</script>'
    r"|<script>(?:(?!</script>).)*?addWidgetsRenderer.*?</script>",
    re.S,
)
HEADING = re.compile(r'<h([1-6]) id="[^"]*">(.*?)<a class="anchor-link" href="#[^"]*">¶</a>(</h\1>)', re.S)
CELL = re.compile(r'(?=<div class="jp-Cell )')
ANCHOR = re.compile(r'(<a\s[^>]*?href=")([^"]*)("[^>]*>)(.*?)(</a>)', re.S)
IMAGE = re.compile(r'(<img\s[^>]*?src=")([^"]*)(")')
TAG_OR_CODE = re.compile(r"(<pre[\s>].*?</pre>|<code[\s>].*?</code>|<[^>]+>)", re.S)
ID = re.compile(r'\s(?:id|name)="([^"]*)"')


def notebook_page(content: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    path = source_path(page)
    for style in STYLE.findall(content):
        NOTEBOOK_STYLES.setdefault(style.replace(".highlight ", ".highlight-ipynb "), None)
    content = REMOTE_SCRIPT.sub("", STYLE.sub("", content))
    headings: list[tuple[int, str, str]] = []

    def heading(match: re.Match) -> str:  # JupyterLab's id, so that links written in JupyterLab work here
        text = heading_text(match.group(2))
        new_id = jupyterlab_id(text)
        headings.append((int(match.group(1)), new_id, text))
        anchor = html.escape(new_id)
        permalink = f'<a class="anchor-link" href="#{anchor}">¶</a>'
        return f'<h{match.group(1)} id="{anchor}">{match.group(2)}{permalink}{match.group(3)}'

    content = HEADING.sub(heading, content)
    hidden = hidden_cells(path)
    # links and images, checked and rewritten as MkDocs does it for a Markdown page (strict mode fails on a broken one)
    resolver = _RelativePathTreeprocessor(page.file, files, config)
    cells = CELL.split(content)
    for i, cell in enumerate(cells):
        head = cell[: cell.find(">") + 1]
        if "jp-MarkdownCell" in head:
            cells[i] = markdown_cell(cell, path, resolver, config)
        elif (match := re.search(r'id="cell-id=([^"]+)"', head)) and match.group(1) in hidden:
            summary = hidden[match.group(1)]
            if summary is None:  # course.css hides it and its wrapper
                cells[i] = cell.replace('class="jp-Cell ', 'class="course-directive jp-Cell ', 1)
            else:
                cells[i] = fold_input(cell, summary)
    content = "".join(cells)
    page.links_to_anchors = resolver.links_to_anchors
    bar = notebook_links(config, page, path)
    first = content.find("</h1>")
    content = content[: first + 5] + bar + content[first + 5 :] if first >= 0 else bar + content
    page.present_anchor_ids = {html.unescape(a) for a in ID.findall(content)}
    page.toc = get_toc(toc_tokens(headings))
    return content


def markdown_cell(cell: str, path: Path, resolver: _RelativePathTreeprocessor, config: MkDocsConfig) -> str:
    def link(match: re.Match) -> str:
        value = html.unescape(match.group(2))
        target = repository_target(path, value)
        if target is not None and target.is_dir():  # a folder of the repository: on GitHub, or plain text
            url = repository_url(config, target)
            return match.group(1) + html.escape(url) + "".join(match.groups()[2:]) if url else match.group(4)
        if value.startswith("data:"):
            return match.group(0)
        return match.group(1) + html.escape(resolver.path_to_url(value)) + "".join(match.groups()[2:])

    cell = ANCHOR.sub(link, cell)
    cell = IMAGE.sub(link, cell)
    pieces = TAG_OR_CODE.split(cell)
    for i in range(0, len(pieces), 2):  # text between tags, never inside code
        pieces[i] = MATH.sub(
            lambda m: mathml(html.unescape(m.group(1) or m.group(2)), m.group(1) is not None), pieces[i]
        )
    return "".join(pieces)


def hidden_cells(path: Path) -> dict[str, str | None]:
    """{cell id: the line that unfolds it} for each code cell that JupyterLab shows with its input collapsed, and
    {cell id: None} for a cell that only holds nbdev's directives (`#| default_exp ...`) and prints nothing."""
    hidden: dict[str, str | None] = {}
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = [line for line in "".join(cell["source"]).splitlines() if line.strip()]
        if lines and all(line.startswith("#|") for line in lines) and not cell.get("outputs"):
            hidden[cell.get("id")] = None
        elif cell.get("metadata", {}).get("jupyter", {}).get("source_hidden"):
            tags = cell["metadata"].get("tags", [])
            hidden[cell.get("id")] = next((HIDDEN_SUMMARY[t] for t in tags if t in HIDDEN_SUMMARY), "Show the code")
    return hidden


def fold_input(cell: str, summary: str) -> str:
    """The cell's code folded into a <details> block that a click opens; its output stays in view."""
    start = cell.find('<div class="jp-Cell-inputWrapper"')
    if start < 0:
        return cell
    depth, end = 0, None
    for tag in re.finditer(r"<(/?)div[\s>]", cell[start:]):
        depth += -1 if tag.group(1) else 1
        if depth == 0:
            end = cell.find(">", start + tag.start()) + 1
            break
    if end is None:
        return cell
    opening = f'<details class="course-hidden-input"><summary>{html.escape(summary)}</summary>'
    return cell[:start] + opening + cell[start:end] + "</details>" + cell[end:]


def notebook_links(config: MkDocsConfig, page: Page, path: Path) -> str:
    """Download the .ipynb (mkdocs-jupyter's include_source puts it beside the page) and, with a repository, open it
    in Colab, Kaggle or Binder."""
    name = html.escape(path.name)
    links = [f'<a class="course-download" href="{name}" download>Download {name}</a>']
    links += [
        f'<a class="course-launch" href="{html.escape(url)}">{label}</a>' for label, url in launch_links(config, path)
    ]
    return '<p class="course-notebook-links">' + " · ".join(links) + "</p>"


def launch_links(config: MkDocsConfig, path: Path) -> list[tuple[str, str]]:
    """("Open in Colab", url), ... for the notebook at `path`; none while repo_url is unset."""
    match = GITHUB.match(config.repo_url or "")
    if not match:
        return []
    owner, name = match.groups()
    branch = config.extra.get("repo_branch", "main")
    rel = path.relative_to(ROOT).as_posix()
    blob = f"https://github.com/{owner}/{name}/blob/{branch}/{rel}"
    return [
        ("Open in Colab", f"https://colab.research.google.com/github/{owner}/{name}/blob/{branch}/{rel}"),
        ("Open in Kaggle", f"https://kaggle.com/kernels/welcome?src={blob}"),
        ("Open in Binder", f"https://mybinder.org/v2/gh/{owner}/{name}/{branch}?labpath={rel}"),
    ]


def repository_url(config: MkDocsConfig, target: Path) -> str | None:
    match = GITHUB.match(config.repo_url or "")
    if not match:
        return None
    owner, name = match.groups()
    branch = config.extra.get("repo_branch", "main")
    kind = "tree" if target.is_dir() else "blob"
    return f"https://github.com/{owner}/{name}/{kind}/{branch}/{target.relative_to(ROOT).as_posix()}"


# --- headings, math --------------------------------------------------------------------------------------------------


def heading_text(inner_html: str) -> str:
    """A heading's text as the reader sees it: no tags, no permalink sign."""
    inner_html = re.sub(r'<a class="(?:anchor-link|headerlink)"[^>]*>.*?</a>', "", inner_html, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", inner_html)).strip()


def jupyterlab_id(text: str) -> str:
    """The id JupyterLab gives a rendered heading: its text, spaces replaced by '-' (punctuation kept)."""
    return text.strip().replace(" ", "-")


def toc_tokens(headings: list[tuple[int, str, str]]) -> list[dict]:
    """The table of contents, nested by level, from (level, id, text) in page order."""
    root: list[dict] = []
    stack: list[dict] = []
    for level, anchor, text in headings:
        token = {"level": level, "id": anchor, "name": html.escape(text), "children": []}
        while stack and stack[-1]["level"] >= level:
            stack.pop()
        (stack[-1]["children"] if stack else root).append(token)
        stack.append(token)
    return root


MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$])\$([^$\n]+?)\$", re.S)


def mathml(tex: str, display: bool) -> str:
    # \_ inside \text{} is an escaped underscore for MathJax; latex2mathml would keep the backslash
    tex = re.sub(r"\\([_%&#$])", r"\1", tex) if "\\text" in tex else tex
    try:
        return latex_to_mathml(tex, display="block" if display else "inline")
    except Exception as error:  # keep the source visible rather than fail the whole site on one formula
        log.warning(f"math {tex!r} not converted: {error}")
        return f"<code>{html.escape(tex)}</code>"


def source_path(page: Page) -> Path:
    return Path(page.file.abs_src_path)
