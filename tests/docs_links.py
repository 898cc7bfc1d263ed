"""Every relative link of README.md and docs/*.md leads somewhere: the file exists and, where
the link names a section (#anchor), the page has a heading with that anchor (GitHub's
rule: lower case, punctuation dropped, spaces to hyphens). And every row of every table has
the columns of its header, and every test a page names (`Suite.Case`, of a suite the tests
define; the history pages aside, which tell what was) is a test of tests/.

    python3 docs_links.py SOURCE_DIR
"""
import os
import re
import sys


def anchors(path):
    found = set()
    in_code = False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"^#+ (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


def cells(row):
    """The cells of a table row: | outside `code` and not escaped."""
    row = re.sub(r"`[^`]*`", "code", row.strip())
    return len(re.split(r"(?<!\\)\|", row.strip("|")))


def table_errors(page, text):
    bad = []
    header = None
    for number, line in enumerate(text.split("\n"), 1):
        if not line.startswith("|"):
            header = None
            continue
        if header is None:
            header = cells(line)
        elif cells(line) != header:
            bad.append(f"{page}:{number}: a table row of {cells(line)} cells under a header of "
                       f"{header}")
    return bad


def defined_tests(root):
    """The GoogleTest cases of tests/, by suite."""
    suites = {}
    for folder, _, files in os.walk(os.path.join(root, "tests")):
        for name in files:
            if name.endswith(".cpp"):
                text = open(os.path.join(folder, name), encoding="utf-8").read()
                for suite, case in re.findall(r"\bTEST(?:_F|_P)?\(\s*(\w+),\s*(\w+)\)", text):
                    suites.setdefault(suite, set()).add(case)
    return suites


def test_errors(page, text, suites):
    bad = []
    for suite, case in re.findall(r"`([A-Z]\w+)\.([A-Z]\w+)`", text):
        if suite in suites and case not in suites[suite]:
            bad.append(f"{page}: `{suite}.{case}`: no such test in tests/")
    return bad


def main(root):
    pages = [os.path.join(root, "README.md")]
    docs = os.path.join(root, "docs")
    pages += sorted(os.path.join(docs, p) for p in os.listdir(docs) if p.endswith(".md"))
    bad = []
    checked = 0
    suites = defined_tests(root)
    for page in pages:
        text = open(page, encoding="utf-8").read()
        # Code is neither links nor tables (kept as empty lines, so that lines keep their numbers).
        text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text,
                      flags=re.S | re.M)
        bad += table_errors(os.path.relpath(page, root), text)
        if "history" not in os.path.basename(page):
            bad += test_errors(os.path.relpath(page, root), text, suites)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
            checked += 1
            if not os.path.exists(dest):
                bad.append(f"{os.path.relpath(page, root)}: {target}: no such file")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                bad.append(f"{os.path.relpath(page, root)}: {target}: no such section")
    for line in bad:
        print(line)
    print(f"{checked} links in {len(pages)} pages, {len(bad)} broken links or table rows")
    return 1 if bad or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
