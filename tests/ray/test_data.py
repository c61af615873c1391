"""PromptStage in a Ray Data pipeline: read_parquet -> map_batches(PromptStage) -> write_parquet
adds `result` and `error` columns (a bad prompt fails alone), the answers are a local engine's,
and Ray Data's checkpointing skips the rows already written."""
from __future__ import annotations

import pytest

import batchprompt as bp

from .conftest import SPAM_SYSTEM, sms_rows

pytestmark = pytest.mark.slow

N = 12
# Ray's CPUs are a count, not cores: Ray Data's own operators (listing files, the checkpoint
# filter actor) reserve one each beside the stage's actor, which two would not hold.
RAY_NUM_CPUS = 4
STAGE = dict(column="prompt", system=SPAM_SYSTEM, dtype="float32", threads=1, max_tokens=6)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [text for _, text in sms_rows(N)]
    prompts = [[{"role": "user", "content": t}] for t in texts]
    prompts[7] = [{"role": "robot", "content": texts[7]}]  # not a chat role: this row fails alone
    path = tmp_path_factory.mktemp("in") / "in.parquet"
    pq.write_table(pa.table({"id": list(range(N)), "prompt": prompts}), path)
    return path, prompts


def run_pipeline(src, dst):
    import ray

    ds = ray.data.read_parquet(str(src))
    ds = ds.map_batches(bp.ray.PromptStage, fn_constructor_kwargs=STAGE, concurrency=1, batch_size=4,
                        num_cpus=0.5)
    ds.write_parquet(str(dst))


def read_rows(dst) -> dict[int, dict]:
    import pyarrow.parquet as pq

    rows = pq.read_table(str(dst)).to_pylist()
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), "a row was written twice"
    return by_id


def test_a_parquet_pipeline_gets_result_and_error_columns(local_ray, table, tmp_path):
    import batchprompt.ray  # noqa: F401  (bp.ray)

    src, prompts = table
    run_pipeline(src, tmp_path / "out")
    rows = read_rows(tmp_path / "out")
    assert sorted(rows) == list(range(N))
    lm = bp.LanguageModel.create(system=SPAM_SYSTEM, dtype="float32", max_tokens=6)
    expected = lm.batch_prompt([p if i != 7 else "placeholder" for i, p in enumerate(prompts)])
    lm.close()
    for i in range(N):
        if i == 7:
            # The row's own error: it named the row's place in its block ("prompt 3 cannot ...").
            assert rows[i]["result"] is None and "role" in rows[i]["error"]
            assert rows[i]["error"].startswith("the prompt cannot be rendered"), rows[i]["error"]
        else:
            assert rows[i]["error"] is None and rows[i]["result"] == expected[i].text
        assert [dict(m) for m in rows[i]["prompt"]] == prompts[i]  # the input columns pass through


def test_with_ray_data_checkpointing_a_second_run_skips_written_rows(local_ray, table, tmp_path):
    import ray
    from ray.data.checkpoint import CheckpointConfig

    import batchprompt.ray  # noqa: F401

    src, _ = table
    ctx = ray.data.DataContext.get_current()
    before = ctx.checkpoint_config
    ctx.checkpoint_config = CheckpointConfig(id_column="id", checkpoint_path=str(tmp_path / "ckpt"),
                                             delete_checkpoint_on_success=False)
    try:
        run_pipeline(src, tmp_path / "first")
        assert sorted(read_rows(tmp_path / "first")) == list(range(N))
        run_pipeline(src, tmp_path / "second")  # every id is checkpointed: nothing runs again
        second = list((tmp_path / "second").glob("*.parquet")) if (tmp_path / "second").exists() else []
        assert sum(len(read_rows(f)) for f in second) == 0
    finally:
        ctx.checkpoint_config = before
