"""`dvc plots show` renders offline: the project's DVC config names a template with Vega inlined."""

import configparser
import json
import re
import subprocess

from experiments.dvc import dvc_env

from tests.helpers import ROOT

TEMPLATE = ROOT / ".dvc" / "plots_offline.html"


def test_the_repository_config_names_the_offline_template():
    config = configparser.ConfigParser()
    config.read(ROOT / ".dvc" / "config")
    assert (ROOT / ".dvc" / config["plots"]["html_template"]) == TEMPLATE and TEMPLATE.exists()
    text = TEMPLATE.read_text()
    assert text.count("{plot_divs}") == 1 and "{scripts}" not in text  # no CDN script tags are inserted
    assert not re.search(r"<script[^>]+src=", text) and "vegaEmbed" in text


def test_plots_render_with_the_data_and_no_network_address(tmp_path):
    (tmp_path / "dvc.yaml").write_text("plots:\n  - loss.json:\n      x: step\n      y: loss\n")
    (tmp_path / "loss.json").write_text(json.dumps([{"step": i, "loss": 2.0 / i} for i in range(1, 6)]))
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True, env=dvc_env())
    subprocess.run(["dvc", "plots", "show", "--html-template", str(TEMPLATE), "-o", "out"], cwd=tmp_path, check=True,
                   env=dvc_env(), capture_output=True)
    page = (tmp_path / "out" / "index.html").read_text()
    assert "cdn.jsdelivr" not in page and not re.search(r"<script[^>]+src=", page)
    assert '"loss": 0.4' in page and "vegaEmbed" in page  # the data and the library that draws it
