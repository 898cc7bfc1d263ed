#!/usr/bin/env python3
"""Every figure of the README has a source: a number with a decimal point (a measured figure:
12.34, 0.70, 1,537.1) in a table or a paragraph of README.md must appear in a page that the
same row, table or paragraph links to (a page of docs/ that gives its command and run), or
stand in a block that scripts/bench_doc.py writes from docs/results/ (checked by BenchDoc).
Versions (2.15.0) and code (`--lr 1e-3`) are not figures.

    python3 figures_check.py SOURCE_DIR [README]

A figure typed into the README without a source, or changed there and not in its source,
fails this check.
"""
import os
import re
import sys

FIGURE = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})*\.\d+(?![\w.])|(?<![\w.,])\d+\.\d+(?![\w.])")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def figures(text):
    text = re.sub(r"`[^`]*`", " ", text)  # code
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    text = re.sub(r"\b\d+\.\d+\.\d+\b", " ", text)  # versions
    text = re.sub(r"(?i)\b(libtorch|torch|python|c\+\+)\s+\d+\.\d+\b", " ", text)
    return FIGURE.findall(text)


def blocks(readme):
    """The README's tables and paragraphs, in order, outside code and generated blocks."""
    text = re.sub(r"^```.*?^```", "", readme, flags=re.S | re.M)
    text = re.sub(r"<!-- bench-doc: \w+ -->.*?<!-- /bench-doc -->", "", text, flags=re.S)
    return [b for b in re.split(r"\n\s*\n", text) if b.strip()]


def main(root, readme_path):
    readme = open(readme_path, encoding="utf-8").read()
    pages = {}

    def page(target):
        path = os.path.normpath(os.path.join(root, target))
        if path not in pages:
            try:
                pages[path] = open(path, encoding="utf-8").read().replace(",", "")
            except OSError:
                pages[path] = ""
        return pages[path]

    bad, checked = [], 0
    parts = blocks(readme)
    for k, part in enumerate(parts):
        is_table = part.lstrip().startswith("|")
        # A table's sources: its own links and its introduction's (the block before it) and
        # the line under it; a row's: its own links first.
        context = [part]
        if is_table:
            context += [parts[k - 1] if k > 0 else "", parts[k + 1] if k + 1 < len(parts) else ""]
        shared = [t for c in context for t in LINK.findall(c) if not re.match(r"^[a-z]+:", t)]
        units = part.split("\n") if is_table else [part]
        for unit in units:
            own = [t for t in LINK.findall(unit) if not re.match(r"^[a-z]+:", t)]
            sources = own + shared
            for figure in figures(unit):
                checked += 1
                plain = figure.replace(",", "")
                if not any(plain in page(t) for t in sources if t.endswith(".md")):
                    where = unit.strip()[:90]
                    bad.append(f"README: {figure} has no source among "
                               f"{', '.join(sorted(set(sources))) or 'no linked page'} ({where})")
    for line in bad:
        print(line)
    print(f"{checked} figures of the README, {len(bad)} without a source")
    return 1 if bad or checked == 0 else 0


if __name__ == "__main__":
    root = sys.argv[1]
    sys.exit(main(root, sys.argv[2] if len(sys.argv) > 2 else os.path.join(root, "README.md")))
