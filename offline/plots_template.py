"""Build ``.dvc/plots_offline.html``: the HTML template of ``dvc plots show`` with Vega, Vega-Lite and Vega-Embed
inlined, so that the plots render with no network (DVC's own template loads them from a CDN: a blank page offline).
``.dvc/config`` names it (``plots.html_template``), so a plain ``dvc plots show`` uses it.

    python offline/plots_template.py            # fetches the three npm packages with `npm pack` (needs npm and a registry)
    python offline/plots_template.py --from DIR # or from .tgz files already in DIR

The versions are pinned below; the template records each file's version and SHA-256. The libraries are BSD-3-Clause
licensed (the University of Washington Interactive Data Lab); their licence texts are kept in the template.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGES = {"vega": ("5.33.1", "build/vega.min.js"), "vega-lite": ("5.23.0", "build/vega-lite.min.js"),
            "vega-embed": ("6.29.0", "build/vega-embed.min.js")}
"""npm package -> (version, the browser build inside it), in loading order."""
OUT = Path(__file__).resolve().parent.parent / ".dvc" / "plots_offline.html"

PAGE = """<!DOCTYPE html>
<html>
<head>
{refresh_tag}
<title>DVC plots (env-engineer, offline)</title>
<!-- Built by offline/plots_template.py. Inlined: {manifest} -->
{inlined}
<style>table {{ border-spacing: 15px; }} body {{ font-family: sans-serif; }}</style>
</head>
<body>
{plot_divs}
</body>
</html>
"""


def read_package(tgz: Path, inner: str) -> tuple[str, str]:
    """The browser build and the licence text of one npm tarball."""
    with tarfile.open(tgz) as tar:
        script = tar.extractfile(f"package/{inner}").read().decode()
        names = tar.getnames()
        if "package/LICENSE" in names:
            licence = tar.extractfile("package/LICENSE").read().decode()
        else:  # some releases ship no licence file: the licence their package.json declares
            meta = json.loads(tar.extractfile("package/package.json").read())
            licence = f"{meta.get('license')} (declared in package.json; copyright {meta.get('author', 'the authors')})"
    return script, licence


def build(source: Path) -> str:
    parts, manifest = [], []
    for name, (version, inner) in PACKAGES.items():
        tgz = source / f"{name}-{version}.tgz"
        if not tgz.exists():
            raise FileNotFoundError(f"{tgz}: missing; run without --from (npm pack {name}@{version})")
        script, licence = read_package(tgz, inner)
        if "</script" in script.lower():
            raise ValueError(f"{tgz}: its build holds '</script', which would end the inlined script early")
        digest = hashlib.sha256(script.encode()).hexdigest()
        manifest.append(f"{name} {version} {inner} sha256 {digest}")
        parts.append(f"<!-- {name} {version} licence:\n{licence.replace('--', '- -')}\n-->\n<script>{script}</script>")
    page = PAGE.replace("{{", "\x00").replace("}}", "\x01")  # literal braces of the style block
    page = page.replace("{manifest}", "; ".join(manifest)).replace("{inlined}", "\n".join(parts))
    return page.replace("\x00", "{").replace("\x01", "}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, default=None, help="folder of the three .tgz files")
    parser.add_argument("--out", type=Path, default=OUT, help="template to write (default: %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source = args.source
        if source is None:
            source = Path(tmp)
            specs = [f"{name}@{version}" for name, (version, _) in PACKAGES.items()]
            subprocess.run(["npm", "pack", "--silent", *specs], cwd=source, check=True, capture_output=True)
        page = build(source)
    for placeholder in ("{plot_divs}", "{refresh_tag}"):
        if page.count(placeholder) != 1:
            print(f"error: the template holds {placeholder} {page.count(placeholder)} times (DVC needs it once)",
                  file=sys.stderr)
            return 1
    args.out.write_text(page, encoding="utf8")
    print(f"wrote {args.out} ({len(page):,} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
