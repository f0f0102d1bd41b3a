"""The CPU share of processes that run at once (pipeline.workers.cpu_share)."""

import pytest

from pipeline.workers import CPU_THREAD_VARIABLES, cpu_share


def test_each_process_gets_its_part_of_the_cores_and_a_value_already_set_is_kept(monkeypatch):
    for name in CPU_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert cpu_share(24, cores=16) == {name: "1" for name in CPU_THREAD_VARIABLES}  # at least one thread each
    assert cpu_share(3, cores=16) == {name: "5" for name in CPU_THREAD_VARIABLES}
    assert cpu_share(1, cores=16) == {}  # one process: the libraries' own defaults
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert cpu_share(3, cores=16)["OMP_NUM_THREADS"] == "4"
    assert int(cpu_share(2)["POLARS_MAX_THREADS"]) >= 1  # this machine's cores
    with pytest.raises(ValueError, match="processes = 0"):
        cpu_share(0)


def test_a_process_started_with_the_share_runs_that_many_torch_threads(monkeypatch):
    """The variables do what they are for: torch in a child process started with the share uses that many threads."""
    import os
    import subprocess
    import sys

    for name in CPU_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    env = {**os.environ, **cpu_share(8, cores=16)}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "2"
