"""The docs a person reads agree with the tree: the README's code map, every relative link, the README's size.

Why: a newcomer reads the README first and follows its map and links; a path that was moved or a link into a
deleted doc sends them nowhere, and nothing else would notice. The code map (README "## Code map") is a table:
the first cell names one or more paths from the repository root, the second names files and folders inside them
(`file.py`, `folder/`, `*.cu` patterns). Both directions are checked: every path the map names exists, and every
package folder and module of vla_edge_ros/ is named in the row of its folder. Links: every relative Markdown link
in README.md, CONTRIBUTING.md and docs/*.md resolves to a file, and a `#fragment` to one of its headings (GitHub's
anchor rule); a plain `docs/NAME.md` mention names an existing doc. No ROS, no network: text only.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 15 * 1024  # issue 20: the README is the newcomer's entry, "under ~15 KB"; details go to docs/

PATH_TOKEN = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FILE_SUFFIXES = (".py", ".cu", ".cuh", ".sh", ".yaml", ".xml", ".md")


def section(text: str, title: str) -> str:
    """The body of the '## title' section (up to the next '## ' heading)."""
    m = re.search(rf"(?m)^## {re.escape(title)}\s*$", text)
    assert m, f"README has no '## {title}' section"
    rest = text[m.end():]
    nxt = re.search(r"(?m)^## ", rest)
    return rest[: nxt.start()] if nxt else rest


def code_map_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """(paths of the first cell, path tokens of the second) per row of the code-map table."""
    rows = []
    for line in section(text, "Code map").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= set("- ") or cells[0] == "path":
            continue
        rows.append((PATH_TOKEN.findall(cells[0]), [t for t in PATH_TOKEN.findall(cells[1]) if is_path(t)]))
    return rows


def is_path(token: str) -> bool:
    return token.endswith("/") or token.endswith(FILE_SUFFIXES)


def resolves(token: str, bases: list[Path]) -> bool:
    """A file, folder or glob pattern under one of the row's folders, or from the repository root."""
    for base in [*bases, ROOT]:
        if any(ch in token for ch in "*?["):
            if list(base.glob(token)):
                return True
        elif (base / token).exists():
            return True
    return False


def github_anchor(heading: str) -> str:
    """GitHub's heading id: lower case, punctuation dropped (letters, digits, '-', '_' and spaces kept), each space
    a hyphen. Markdown code ticks are punctuation too."""
    text = heading.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "-_ ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text(encoding="utf-8"))  # no headings inside code blocks
    return {github_anchor(m.group(1)) for m in re.finditer(r"(?m)^#{1,6}\s+(.*?)\s*#*\s*$", text)}


# ---- the code map ----------------------------------------------------------------------------------------------

def test_code_map_names_only_paths_that_exist():
    rows = code_map_rows(README.read_text(encoding="utf-8"))
    assert len(rows) >= 8, f"README code map has {len(rows)} rows"
    missing = []
    for firsts, tokens in rows:
        bases = [ROOT / p for p in firsts]
        missing += [p for p in firsts if not (ROOT / p).exists()]
        missing += [f"{t} (row {', '.join(firsts)})" for t in tokens if not resolves(t, bases)]
    assert not missing, "README code map names paths that do not exist: " + "; ".join(missing)


def test_code_map_covers_every_package_and_module():
    rows = code_map_rows(README.read_text(encoding="utf-8"))
    named = {}
    for firsts, tokens in rows:
        for p in firsts:
            named.setdefault(p.rstrip("/"), set()).update(t.rstrip("/") for t in tokens)
    pkg = ROOT / "vla_edge_ros"
    absent = []
    for init in sorted(pkg.rglob("__init__.py")):
        folder = init.parent.relative_to(ROOT).as_posix()
        if folder == "vla_edge_ros":
            modules = [m for m in sorted(init.parent.glob("*.py")) if not m.name.startswith("__")]
            absent += [f"vla_edge_ros/{m.name}" for m in modules if f"vla_edge_ros/{m.name}" not in named]
            continue
        if folder not in named:
            absent.append(f"{folder}/ (no row)")
            continue
        for m in sorted(init.parent.glob("*.py")):
            if not m.name.startswith("__") and m.name not in named[folder]:
                absent.append(f"{folder}/{m.name}")
        for sub in sorted(d for d in init.parent.iterdir() if (d / "__init__.py").exists()):
            if sub.relative_to(ROOT).as_posix() not in named:
                absent.append(f"{sub.relative_to(ROOT).as_posix()}/ (no row)")
    assert not absent, "README code map misses (add them to the row of their folder): " + "; ".join(absent)


def test_code_map_parser_sees_a_wrong_path():
    """The checks above can fail: a map naming a file that is not there is caught."""
    text = "## Code map\n\n| path | what |\n| --- | --- |\n| `vla_edge_ros/core/` | `no_such_module.py` |\n"
    (firsts, tokens), = code_map_rows(text)
    assert firsts == ["vla_edge_ros/core/"] and tokens == ["no_such_module.py"]
    assert not resolves("no_such_module.py", [ROOT / "vla_edge_ros/core"])
    assert resolves("admission.py", [ROOT / "vla_edge_ros/core"])


# ---- links -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    text = doc.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target} (no {file_part})")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.name})")
    for mention in set(re.findall(r"(?<![\w/.-])docs/[\w.-]+\.md", text)):
        if not (ROOT / mention).exists():
            broken.append(f"{mention} (mentioned, does not exist)")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(sorted(broken))


def test_anchor_rule_matches_github_for_our_headings():
    assert github_anchor("Split deployment (robot ↔ edge server)") == "split-deployment-robot--edge-server"
    assert github_anchor("Evaluation: `make eval` (`vla_eval`, bench/eval.py)") == \
        "evaluation-make-eval-vla_eval-benchevalpy"


def test_readme_stays_the_short_entry():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes (limit {README_MAX_BYTES}): move detail into "
                                      "docs/ and link to it")
