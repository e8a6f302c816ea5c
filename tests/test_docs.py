"""The user docs against the code: defaults in README.md and docs/config.md equal config.py's, every relative
link and #anchor resolves (GitHub's anchors), every config in configs/ validates, and a config's learning-rate
schedule lasts at least as long as the docs tell users to run it. Fast: no processes."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ds_dragonn.config import AdvancedConfig, DragonnConfig

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
ROW = re.compile(r"^\|\s*`([a-z_0-9]+)`\s*\|(.*)\|\s*$")


def _table(text: str, header: str) -> list:
    """The rows (cells, stripped) of the first Markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _default(model, key):
    value = model.model_fields[key].default
    return getattr(value, "value", value)


def _literal(cell: str):
    """A table's default cell (`` `0.01` ``, `` `"auto"` ``, `` `null` ``) as the Python value."""
    return json.loads(cell.strip("`"))


def _section(text: str, title: str) -> str:
    return text.split(title, 1)[1].split("\n## ", 1)[0]


def test_config_md_lists_every_key_with_config_py_default():
    text = (REPO / "docs" / "config.md").read_text()
    main = {r[0].strip("`"): r for r in _table(text, "| key | type | default |")}
    visible = [k for k in DragonnConfig.model_fields if k != "advanced"]
    assert list(main) == visible and len(main) == 15, list(main)
    for key, row in main.items():
        assert _literal(row[2]) == _default(DragonnConfig, key), (key, row[2])
    adv = {r[0].strip("`"): r for r in _table(_section(text, "## advanced"), "| key | type | default |")}
    assert list(adv) == list(AdvancedConfig.model_fields)
    for key, row in adv.items():
        assert _literal(row[2]) == _default(AdvancedConfig, key), (key, row[2])
    assert f"**{len(visible)} keys and one `advanced` object.**" in text  # the stated count


def test_readme_key_table_has_config_py_defaults():
    text = (REPO / "README.md").read_text()
    rows = _table(text, "| key | default | meaning |")
    assert [r[0].strip("`") for r in rows] == [k for k in DragonnConfig.model_fields if k != "advanced"]
    for row in rows:
        assert _literal(row[1]) == _default(DragonnConfig, row[0].strip("`")), row


@pytest.mark.parametrize("path, header", [("README.md", "| key | default | meaning |"),
                                          ("README.md", "| what | measured | details |"),
                                          ("docs/config.md", "| key | type | default |")])
def test_reference_cells_are_short(path, header):
    rows = _table((REPO / path).read_text(), header)
    assert rows
    long = [c for r in rows for c in r if len(re.sub(r"\([^)]*\)", "", c).split()) > 30]
    assert not long, long


def _slug(title: str) -> str:
    """GitHub's heading anchor: lower case, markup and punctuation dropped, spaces to hyphens."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).strip().lower()
    title = re.sub(r"[^\w\- ]", "", title)
    return title.replace(" ", "-")


def _anchors(path: Path) -> set:
    seen: dict = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links():
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for m in LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if not re.match(r"[a-z]+:", target):
                yield doc, target


def test_links_and_anchors_resolve():
    links = list(_links())
    assert len(links) > 50 and any("#" in t for _, t in links)
    bad = []
    for doc, target in links:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{doc.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{doc.name}: {target} (no such anchor)")
    assert not bad, "\n".join(bad)


def test_slug_follows_github():
    assert _slug("Local steps: `\"sync\": \"local_steps\"` (DiLoCo / SparseLoCo inside DeepSpeed)") == \
        "local-steps-sync-local_steps-diloco--sparseloco-inside-deepspeed"
    assert _slug("4. Exchange (ZeRO 0)") == "4-exchange-zero-0"


CONFIGS = sorted((REPO / "configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_validates(path):
    DragonnConfig.from_ds_config(str(path))


def _advised_steps():
    """(config name, steps) for every command in the docs that runs a config with --steps."""
    pattern = re.compile(r"--deepspeed_config\s+configs/(\S+?\.json)(?:[^\n]*\\\n)*[^\n]*?--steps\s+(\d+)")
    for doc in DOCS:
        for m in pattern.finditer(doc.read_text()):
            yield m.group(1), int(m.group(2))


def test_schedules_last_as_long_as_the_docs_advise():
    advised = list(_advised_steps())
    assert advised, "no documented command with --deepspeed_config configs/... --steps N"
    for name, steps in advised:
        cfg = json.loads((REPO / "configs" / name).read_text())
        total = cfg.get("scheduler", {}).get("params", {}).get("total_num_steps")
        assert total is None or total >= steps, f"{name}: the docs advise {steps} steps, its schedule ends at {total}"
    assert len(CONFIGS) >= 9
