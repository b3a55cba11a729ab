"""
Sphinx configuration of pyro_tmc's documentation site.

Build (from the repository root, after ``pip install -e ".[docs]"``)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The pages reuse the repository's own text: README.md, API.md and RESULTS.md are included by
section (between ``<!-- docs:... -->`` markers or headings), and the notebooks in ``tutorials/``
are copied to ``docs/tutorials/`` at every build and rendered with their saved outputs, never
executed. The benchmarks' archived work log (benchmarks/HISTORY.md) is not part of the site.
"""

import importlib.util
import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path.insert(0, str(REPO))  # document this checkout, installed or not

import pyro_tmc  # noqa: E402

project = "pyro_tmc"
author = "pyro_tmc contributors"
copyright = "pyro_tmc contributors"
version = release = pyro_tmc.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "myst_nb",  # Markdown (MyST) pages and notebooks
]

# Notebooks: rendered with the outputs saved in them (tests/test_tutorials.py checks those exist).
nb_execution_mode = "off"
nb_merge_streams = True

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True}
# Overridden methods without a docstring of their own (Lightning hooks, Pyro ELBO methods) are left
# out rather than shown with their base class's text, whose markup is not ours.
autodoc_inherit_docstrings = False
# pyro_tmc.contrib.lightning needs the optional lightning package: stand it in when it is not installed.
autodoc_mock_imports = [] if importlib.util.find_spec("lightning") else ["lightning"]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
html_theme = "furo"
html_title = f"pyro_tmc {release}"
html_static_path = []


# --- the tutorials: copied from tutorials/ on every build (docs/tutorials is generated, not kept in git)


def _copy_tutorials() -> None:
    target = DOCS / "tutorials"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir()
    for notebook in sorted((REPO / "tutorials").glob("[0-9][0-9]_*.ipynb")):
        shutil.copy2(notebook, target / notebook.name)


_copy_tutorials()


# --- text included from the repository's Markdown files: links rewritten to the site's pages

#: repository path -> page of this site
PAGES = {
    "README.md": "index.md",
    "API.md": "interface.md",
    "RESULTS.md": "results.md",
    "tutorials": "tutorials.md",
    "tutorials/": "tutorials.md",
}
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def _site_target(target: str):
    """Where a repository-relative link points on this site; None when it has no page here."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return target  # a URL or an anchor of the same page
    path, _, anchor = target.partition("#")
    if path in PAGES:
        page = PAGES[path]
    elif path.startswith("tutorials/") and path.endswith(".ipynb"):
        page = path  # copied beside the other pages
    elif path.startswith("docs/"):
        page = path[len("docs/") :]  # figures
    else:
        return None
    return page + ("#" + anchor if anchor else "")


def _rewrite_links(text: str) -> str:
    def rewrite(match):
        bang, label, target = match.groups()
        new = _site_target(target)
        if new is None:  # a source file of the repository: its name, as text
            return label if label else target
        return f"{bang}[{label}]({new})"

    return _LINK.sub(rewrite, text)


def _include_read(app, relative_path, parent_docname, content) -> None:
    if Path(relative_path).suffix == ".md":
        content[0] = _rewrite_links(content[0])


# --- docstrings: a list of references, one "[n] ..." a line with indented continuations, reads as
# intended in the source but is one paragraph to reStructuredText; a blank line before each entry
# makes each its own block.

_REFERENCE = re.compile(r"^\[\d+\] ")


def _separate_references(app, what, name, obj, options, lines) -> None:
    for i in range(len(lines) - 1, 0, -1):
        if _REFERENCE.match(lines[i]) and lines[i - 1].strip():
            lines.insert(i, "")


def setup(app):
    app.connect("include-read", _include_read)
    app.connect("autodoc-process-docstring", _separate_references)
