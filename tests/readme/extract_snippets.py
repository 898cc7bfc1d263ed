"""Writes every ```cpp block of README.md and of the docs/ pages into one C++ file, so that
the build compiles (and links) each of them: a snippet that does not compile fails the build.

Each block becomes the body of a function of its own, after the names the README takes
as given (readme_given.h: `model`, `trainer`, `images`, ...), which the block may shadow
with its own. Its #include lines go to the top of the file.

    python extract_snippets.py out.cpp README.md docs/*.md
"""
import os
import re
import sys

GIVEN = ["images", "labels", "test_images", "test_labels", "x", "loss", "params",
         "sample_batch", "worst_case_batch", "global_batch", "test_set", "model", "seq",
         "block", "optimizer", "adam", "trainer", "loss_fn", "tokens", "next_tokens", "padding_mask"]


def main(out, pages):
    blocks = []
    for page in pages:
        text = open(page, encoding="utf-8").read()
        name = os.path.join(os.path.basename(os.path.dirname(page)), os.path.basename(page))
        for match in re.finditer(r"^```cpp\n(.*?)^```", text, flags=re.S | re.M):
            line = text.count("\n", 0, match.start()) + 2
            blocks.append((f"{name.lstrip('./')}, line {line}", match.group(1)))
    includes, bodies = [], []
    for n, (line, code) in enumerate(blocks):
        kept = []
        for row in code.splitlines():
            if row.startswith("#include"):
                includes.append(row)
            else:
                kept.append("    " + row if row else "")
        given = "\n".join(f"  [[maybe_unused]] auto& {g} = given.{g};" for g in GIVEN)
        bodies.append(f"// {line}\n"
                      f"void snippet_{n}(readme::Given& given) {{\n{given}\n  {{\n"
                      + "\n".join(kept) + "\n  }\n}\n")
    with open(out, "w", encoding="utf-8") as f:
        f.write("// Generated from README.md and docs/ by tests/readme/extract_snippets.py. "
                "Do not edit.\n")
        for inc in sorted(set(includes)):
            f.write(inc + "\n")
        f.write('#include "readme_given.h"\n\n')
        f.write("\n".join(bodies))
        f.write(f"\nint readme_snippet_count() {{ return {len(blocks)}; }}\n")
        f.write("void (*readme_snippets[])(readme::Given&) = {"
                + ", ".join(f"snippet_{n}" for n in range(len(blocks))) + "};\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
