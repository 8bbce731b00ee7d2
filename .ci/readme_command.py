"""Print one of the README's two commands (``demo`` or ``test``) exactly as the README writes it.

The README's "## Two commands" section has two ```bash blocks: the first runs the demo, the second
the tests. CI runs what this prints, so the README cannot drift from what CI proves.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def commands() -> dict[str, str]:
    text = README.read_text()
    section = re.search(r"^## Two commands\n(.*?)(?=^## )", text, re.S | re.M)
    if section is None:
        raise SystemExit("README.md has no '## Two commands' section")
    blocks = re.findall(r"```bash\n(.*?)```", section.group(1), re.S)
    if len(blocks) != 2:
        raise SystemExit(f"'## Two commands' has {len(blocks)} bash blocks, expected 2")
    found = {}
    for name, block in zip(("demo", "test"), blocks, strict=True):
        lines = [line for line in block.splitlines() if line.strip()]
        if len(lines) != 1:
            raise SystemExit(f"the {name} command is not one line: {block!r}")
        found[name] = lines[0].strip()
    return found


if __name__ == "__main__":
    print(commands()[sys.argv[1]])
