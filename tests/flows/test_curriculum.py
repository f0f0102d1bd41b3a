"""The Prefect flow against a real Prefect server, read back through its API: one task per DVC stage, named after it,
in DVC's order, with the artifacts; overrides become a DVC experiment, and a bad override fails before anything runs."""

from __future__ import annotations


from tests.conftest import sh


def test_prefect_flow_against_a_real_server(reproduced):
    repo, _ = reproduced
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        from experiments.dvc import pipeline_stages
        from flows.curriculum import curriculum

        state = curriculum(repo=str(repo), return_state=True)
        assert state.is_completed(), state
        result = state.result()
        assert result == {"stages": [0, 1]}

        import asyncio

        async def read_back():
            async with get_client() as client:
                flow_run = await client.read_flow_run(state.state_details.flow_run_id)
                task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
                artifacts = await client.read_artifacts()
                return flow_run, task_runs, artifacts

        flow_run, task_runs, artifacts = asyncio.run(read_back())
        assert flow_run.state.is_completed()
        names = {t.name for t in task_runs}
        assert {s.name for s in pipeline_stages(repo)} <= names  # every stage of dvc.yaml, no second list
        assert {"validation-set", "benchmark", "init-curriculum", "train@0", "engineer-config@1"} <= names
        assert all(t.state.is_completed() for t in task_runs)
        keys = {a.key for a in artifacts}
        assert {"stage-0-metrics", "stage-0-config-diff", "stage-1-metrics"} <= keys

        # A run with overrides (as from the UI) becomes a DVC experiment; the workspace is left as it was.
        params_before = (repo / "params.yaml").read_text()
        exp = curriculum(repo=str(repo), overrides={"train.trajectories": 4}, return_state=True)
        assert exp.is_completed(), exp
        assert (repo / "params.yaml").read_text() == params_before
        shown = sh(["dvc", "exp", "show", "--json"], repo).stdout
        assert '"trajectories": 4' in shown
        bad = curriculum(repo=str(repo), overrides={"train.trajectoris": 4}, return_state=True)
        assert bad.is_failed() and "train.trajectoris" in str(bad.message or "") + repr(bad.result(raise_on_failure=False))
