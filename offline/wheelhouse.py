"""Build a wheelhouse: every wheel env-engineer needs on a machine without a package registry (an air-gapped GPU cluster),
for that machine's Python and platform, built on a machine that has one.

    # on the target, once: what it already has (its torch, CUDA libraries, transformers ... stay as they are)
    python3 -m pip freeze > target-freeze.txt
    # here, with the target's Python version (any platform): the wheels for the target
    python3.12 offline/wheelhouse.py --out wheelhouse --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        --have target-freeze.txt [--extras gpu]
    # there, after copying the checkout and wheelhouse/ over: a virtualenv that sees the target's packages, plus the rest
    python3 offline/wheelhouse.py --check wheelhouse
    python3 -m venv --system-site-packages .venv && .venv/bin/pip install --no-index --find-links wheelhouse -e .

What it does, all with pip: builds the project's own wheel and the wheels of requirements published only as source
(``--build``: pure-Python ones such as ``antlr4-python3-runtime``, which DVC's ``hydra-core`` needs); makes a
metadata-only stand-in wheel for every package the target has (``--have``: its version with the local label
``+target``, no requirements of its own: what is installed there brings its own requirements along); resolves the whole
requirement set for the target with ``pip install --dry-run --report``, only binary wheels for ``--platform`` and
``--python-version``, the stand-ins pinned (a version of the target's that a requirement excludes is named, unpinned,
and pip chooses one that fits, which the virtualenv then holds in front of the target's); downloads the resolved wheels
that are not stand-ins (``pip download --no-deps --only-binary=:all:``); installs the whole set from the wheelhouse and
the stand-ins alone, as a dry run with no index, as the target will; and writes ``MANIFEST.txt`` (file, bytes, sha256
of each wheel), which ``--check`` compares with a copy. Extras that requirements ask of the target's packages
(``httpx[http2]``) are read from those packages' real metadata and their requirements added. Without ``--have`` everything is downloaded, torch and
its CUDA libraries included (several GB).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ONLY = ("antlr4-python3-runtime==4.9.3",)
"""Requirements published only as source distributions, built here into (pure-Python) wheels."""
STAND_IN = "target"
"""Local version label of the stand-ins for what the target has."""


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
"""The older names of the glibc 2.17, 2.12 and 2.5 manylinux tags (PEP 600)."""


def platform_tags(given: list[str]) -> list[str]:
    """``given`` with every older manylinux tag a ``manylinux_2_N_ARCH`` machine also runs added after it (pip's
    ``--platform`` takes exact tags: asked for ``manylinux_2_28_x86_64`` alone, it finds no wheel of a package
    published only as ``manylinux_2_17``/``manylinux2014``, and resolution fails). Other tags are kept as given."""
    out: list[str] = []
    for tag in given:
        out.append(tag)
        if found := re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag):
            arch = found.group(2)
            for minor in range(int(found.group(1)), 4, -1):
                out.append(f"manylinux_2_{minor}_{arch}")
                if minor in LEGACY_MANYLINUX:
                    out.append(f"{LEGACY_MANYLINUX[minor]}_{arch}")
    return list(dict.fromkeys(out))  # first occurrence kept, in order


def pip(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=not capture, capture_output=capture, text=True)


def installed_on_target(freeze: Path | None) -> dict[str, str]:
    """``name -> version`` (public part) from a ``pip freeze`` of the target; other lines are ignored."""
    if freeze is None:
        return {}
    have = {}
    for line in freeze.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and name and not name.startswith("#"):
            have[canonical(name)] = version.strip().split("+")[0]
    return have


def stand_in(folder: Path, name: str, version: str) -> Path:
    """A wheel holding only metadata: distribution ``name`` at ``version+target``, with no requirements."""
    full = f"{version}+{STAND_IN}"
    stem = f"{name.replace('-', '_')}-{full}"
    files = {f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {full}\n",
             f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: env-engineer\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).decode().rstrip('=')},"
                     f"{len(text.encode())}\n" for path, text in files.items())
    files[f"{stem}.dist-info/RECORD"] = record + f"{stem}.dist-info/RECORD,,\n"
    path = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for inner, text in files.items():
            z.writestr(inner, text)
    return path


def resolve(requirements: list[str], links: list[Path], target: list[str], pins: dict[str, str], tries: int = 30) -> list[dict]:
    """The metadata (name, version) of every distribution ``requirement`` needs on the target, as pip resolves it with
    the versions of ``pins``; a pin that a reported conflict names is dropped, said so, and pip tries again."""
    pins = dict(pins)
    with tempfile.TemporaryDirectory() as tmp:
        report, constraints = Path(tmp) / "report.json", Path(tmp) / "constraints.txt"
        for _ in range(tries):
            constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
            links_args = [arg for link in links for arg in ("--find-links", str(link))]
            proc = pip("install", "--dry-run", "--ignore-installed", "--report", str(report), "--target",
                       str(Path(tmp) / "site"), *links_args, *target, "--constraint", str(constraints), *requirements,
                       capture=True)
            if proc.returncode == 0:
                return [item["metadata"] for item in json.loads(report.read_text())["install"]]
            text = proc.stdout + proc.stderr
            cause = text[text.find("The conflict is caused by"):] if "The conflict is caused by" in text else text[-4000:]
            named = re.findall(r"The user requested \(constraint\) ([A-Za-z0-9_.\-]+)==", cause)
            named += re.findall(r"depends on ([A-Za-z0-9_.\-]+)", cause)
            named += re.findall(r"requirement ([A-Za-z0-9_.\-]+)[<>=!~]", cause)
            clashing = {canonical(n) for n in named} & set(pins)
            if not clashing:
                sys.stderr.write(cause[:4000])
                raise SystemExit(f"pip cannot resolve {requirements[0]} for the target (see above)")
            for name in sorted(clashing):
                print(f"note: the target's {name} {pins.pop(name).split('+')[0]} does not fit what env-engineer needs; "
                      "the wheelhouse brings a version that does", flush=True)
    raise SystemExit(f"pip could not resolve {requirements[0]} for the target in {tries} tries")


def extra_requirements(resolved: list[dict], links: list[Path], target: list[str], python_version: str) -> list[str]:
    """The requirements that extras put on stand-ins bring in (``httpx[http2]`` needs ``h2``): a stand-in has no
    metadata of its own, so each such package's real metadata is read (``pip install --dry-run --no-deps``, metadata
    only) and its requirements for those extras returned."""
    Requirement = _requirement_class()
    env = _environment(python_version)
    stand_ins = {canonical(m["name"]): m["version"].split("+")[0] for m in resolved if m["version"].endswith(f"+{STAND_IN}")}
    wanted: dict[str, set[str]] = {}
    for meta in resolved:
        for text in meta.get("requires_dist") or []:
            req = Requirement(text)
            if req.extras and canonical(req.name) in stand_ins:
                wanted.setdefault(canonical(req.name), set()).update(req.extras)
    out = []
    for name, extras in sorted(wanted.items()):
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            pip("install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet", "--report", str(report), "--target",
                str(Path(tmp) / "site"), *target, f"{name}=={stand_ins[name]}", capture=True)
            if not report.exists():
                continue
            metas = [item["metadata"] for item in json.loads(report.read_text())["install"]]
        for text in (metas[0].get("requires_dist") or []) if metas else []:
            req = Requirement(text)
            if req.marker is not None and any(req.marker.evaluate({**env, "extra": e}) for e in extras) \
                    and not req.marker.evaluate({**env, "extra": ""}):
                out.append(str(req).split(";")[0].strip())
    return out


def _requirement_class():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def _environment(python_version: str) -> dict[str, str]:
    """Marker values of a Linux x86_64 CPython target."""
    return {"python_version": python_version, "python_full_version": f"{python_version}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def manifest(out: Path) -> str:
    lines = []
    for wheel in sorted(out.glob("*.whl")):
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        lines.append(f"{wheel.name} {wheel.stat().st_size} {digest}")
    return "\n".join(lines) + "\n"


def check(out: Path) -> int:
    """Compare a copied wheelhouse with its MANIFEST.txt; returns the number of problems."""
    expected = {}
    for line in (out / "MANIFEST.txt").read_text().splitlines():
        name, size, digest = line.split()
        expected[name] = (int(size), digest)
    problems = 0
    for name, (size, digest) in expected.items():
        wheel = out / name
        if not wheel.exists() or wheel.stat().st_size != size or hashlib.sha256(wheel.read_bytes()).hexdigest() != digest:
            print(f"{name}: missing or changed")
            problems += 1
    print(f"{out}: {len(expected) - problems} of {len(expected)} wheels as built")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("wheelhouse"), help="the wheelhouse folder (default %(default)s)")
    parser.add_argument("--python-version", default="3.12", help="the target's Python, e.g. 3.12 (default %(default)s)")
    parser.add_argument("--platform", action="append", default=None,
                        help="the target's platform tag(s), repeatable; a manylinux_2_N tag brings the older manylinux "
                        "tags such a machine runs (default manylinux_2_28_x86_64)")
    parser.add_argument("--have", type=Path, default=None, help="`pip freeze` of the target: what it has is neither "
                        "resolved again nor downloaded")
    parser.add_argument("--extras", default="", help="the project's extras to include beside `pipeline`, e.g. gpu")
    parser.add_argument("--build", action="append", default=list(SOURCE_ONLY), metavar="REQ",
                        help=f"a source-only requirement to build into a wheel here (default {', '.join(SOURCE_ONLY)})")
    parser.add_argument("--check", type=Path, default=None, metavar="WHEELHOUSE",
                        help="only check a copied wheelhouse against its MANIFEST.txt")
    args = parser.parse_args(argv)
    if args.check is not None:
        return 1 if check(args.check) else 0
    if ".".join(map(str, sys.version_info[:2])) != args.python_version:
        parser.error(f"run this with Python {args.python_version}, the target's (this is "
                     f"{sys.version_info[0]}.{sys.version_info[1]}): pip checks each package's Requires-Python against "
                     "the Python it runs on; the platform may differ")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    platforms = platform_tags(args.platform or ["manylinux_2_28_x86_64"])
    target = ["--only-binary=:all:", "--python-version", args.python_version, "--implementation", "cp"]
    for p in platforms:
        target += ["--platform", p]
    pip("wheel", "--no-deps", "--wheel-dir", str(out), str(ROOT))
    for requirement in args.build:
        pip("wheel", "--no-deps", "--wheel-dir", str(out), requirement)
    extras = ["pipeline", *(e.strip() for e in args.extras.split(",") if e.strip() and e.strip() != "pipeline")]
    requirement = f"env-engineer[{','.join(extras)}]" if extras else "env-engineer"
    have = installed_on_target(args.have)
    with tempfile.TemporaryDirectory() as stubs:
        for name, version in have.items():
            stand_in(Path(stubs), name, version)
        pins = {name: f"{version}+{STAND_IN}" for name, version in have.items()}
        requirements = [requirement]
        for _ in range(5):  # until the extras on stand-ins bring in nothing new
            resolved = resolve(requirements, [out, Path(stubs)], target, pins)
            more = sorted(set(extra_requirements(resolved, [out], target, args.python_version)) - set(requirements))
            if not more:
                break
            print(f"note: extras of the target's packages need {', '.join(more)}", flush=True)
            requirements += more
        built = {canonical(r.split("==")[0]) for r in args.build} | {"env-engineer"}
        wanted = sorted((m["name"], m["version"]) for m in resolved
                        if not m["version"].endswith(f"+{STAND_IN}") and canonical(m["name"]) not in built)
        if wanted:
            pins_file = out / "download.txt"
            pins_file.write_text("".join(f"{n}=={v}\n" for n, v in wanted))
            pip("download", "--no-deps", "--dest", str(out), *target, "--requirement", str(pins_file))
        # the check the target will make: everything from the wheelhouse and what it has, nothing from an index
        with tempfile.TemporaryDirectory() as tmp:
            pip("install", "--dry-run", "--no-index", "--quiet", "--find-links", str(out), "--find-links", stubs,
                "--target", tmp, *target, *requirements)
    (out / "MANIFEST.txt").write_text(manifest(out))
    total = sum(w.stat().st_size for w in out.glob("*.whl"))
    kept = sum(m["version"].endswith(f"+{STAND_IN}") for m in resolved)
    print(f"{out}: {len(list(out.glob('*.whl')))} wheels, {total / 1e6:.1f} MB; of the {len(resolved)} distributions "
          f"env-engineer needs there, {kept} are the target's own")
    return 0


if __name__ == "__main__":
    sys.exit(main())
