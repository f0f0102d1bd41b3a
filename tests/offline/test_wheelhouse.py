"""The wheelhouse builder's offline parts: the target's freeze, the stand-in wheels pip accepts, the manifest check."""

import importlib.util
import subprocess
import sys

import pytest

from tests.helpers import ROOT

spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "offline" / "wheelhouse.py")
wheelhouse = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheelhouse)


def test_the_targets_freeze_is_read_by_canonical_name_and_public_version(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torch==2.11.0+cu130\nPyYAML==6.0.3\n# a comment\nmypkg @ file:///src/mypkg\nhuggingface_hub==1.33.0\n")
    assert wheelhouse.installed_on_target(freeze) == {"torch": "2.11.0", "pyyaml": "6.0.3", "huggingface-hub": "1.33.0"}
    assert wheelhouse.installed_on_target(None) == {}


def test_a_stand_in_is_a_wheel_pip_installs_offline_with_no_requirements(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    path = wheelhouse.stand_in(wheels, "huggingface-hub", "1.33.0")
    assert path.name == "huggingface_hub-1.33.0+target-py3-none-any.whl"
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels),
                    "--target", str(site), "huggingface-hub==1.33.0+target"], check=True)
    meta = next(site.glob("huggingface_hub-1.33.0+target.dist-info")) / "METADATA"
    assert "Version: 1.33.0+target" in meta.read_text() and "Requires-Dist" not in meta.read_text()


def test_the_manifest_check_finds_a_changed_or_missing_wheel(tmp_path, capsys):
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"a")
    (tmp_path / "b-1.0-py3-none-any.whl").write_bytes(b"b")
    (tmp_path / "MANIFEST.txt").write_text(wheelhouse.manifest(tmp_path))
    assert wheelhouse.check(tmp_path) == 0
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"changed")
    (tmp_path / "b-1.0-py3-none-any.whl").unlink()
    assert wheelhouse.check(tmp_path) == 2
    assert "0 of 2 wheels as built" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # another Python than the target's: refused, since pip checks Requires-Python
        wheelhouse.main(["--python-version", "2.7"])


def test_a_manylinux_platform_brings_the_older_tags_its_machines_run():
    """pip's --platform takes exact tags: manylinux_2_28 alone missed wheels tagged only manylinux_2_17/manylinux2014
    (rpds-py's), and resolution failed; each manylinux_2_N tag now brings every older one, other tags as given."""
    tags = wheelhouse.platform_tags(["manylinux_2_28_x86_64"])
    assert tags[0] == "manylinux_2_28_x86_64" and len(tags) == len(set(tags))
    assert {f"manylinux_2_{m}_x86_64" for m in range(5, 29)} | {"manylinux2014_x86_64", "manylinux2010_x86_64",
                                                                "manylinux1_x86_64"} == set(tags)
    mixed = wheelhouse.platform_tags(["linux_x86_64", "manylinux_2_17_aarch64"])
    assert mixed[:3] == ["linux_x86_64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"]
    assert "manylinux1_aarch64" in mixed and not any("x86_64" in t for t in mixed[1:])
