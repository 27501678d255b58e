"""common.job_parts: a resumable JSONL job split over processes, with the processes played in turn in this one
(a stand-in for accelerate's state whose barrier returns at once; the real two-process runs are in
tests/test_inference_multiprocess.py). The merged output equals one process's; a part no process 0 can see is an
error naming the missing records; results made with other settings are never resumed."""

import json
from types import SimpleNamespace

import pytest

from common.files import read_jsonl
from common.job_parts import JobParts

ROWS = [{"id": f"q{i}"} for i in range(7)]


def processes(out, n):
    return [
        JobParts(out, SimpleNamespace(process_index=r, num_processes=n, wait_for_everyone=lambda: None))
        for r in range(n)
    ]


def run(parts, rows=ROWS, batch_size=2, stop_after=None):
    """Each process's batches, answered as ``{id, by}``; ``stop_after``: processes that stop (crash) after that many
    batches, before the final merge."""
    batches = [p.start(rows, batch_size) for p in parts]
    for p, mine in zip(parts, batches):
        for b, batch in enumerate(mine):
            if stop_after is not None and b >= stop_after:
                break
            p.append([{"id": r["id"], "by": p.rank} for r in batch])
    if stop_after is None:
        return [p.finish(rows) for p in reversed(parts)][::-1]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_merged_output_is_in_input_order_whatever_the_process_count(tmp_path, n):
    out = tmp_path / "out.jsonl"
    assert run(processes(out, n)) == [True] + [False] * (n - 1)
    merged = list(read_jsonl(out))
    assert [r["id"] for r in merged] == [r["id"] for r in ROWS]
    assert [r["by"] for r in merged] == [(i // 2) % n for i in range(len(ROWS))]  # batch b went to process b mod n
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]  # no part left


def test_an_interrupted_run_resumes_with_another_process_count(tmp_path):
    out = tmp_path / "out.jsonl"
    run(processes(out, 3), stop_after=1)  # each of 3 did one batch of 2: q0–q5 done, q6 not
    parts = processes(out, 2)
    assert [len(b) for b in (p.start(ROWS, 2) for p in parts)] == [1, 0]
    assert [p.status for p in parts][0].startswith("process 0/2: 6 of 7 done")


def test_a_part_process_0_cannot_see_is_an_error_naming_the_missing_records(tmp_path):
    """Process 1 writes to a folder of its own (node-local disk on another node): the merge is short, and says so."""
    (tmp_path / "node1").mkdir()
    first, second = processes(tmp_path / "out.jsonl", 2)
    elsewhere = JobParts(tmp_path / "node1" / "out.jsonl", second.state)
    for p in (first, elsewhere):
        for batch in p.start(ROWS, 2):
            p.append([{"id": r["id"]} for r in batch])
    elsewhere.finish(ROWS)
    with pytest.raises(RuntimeError, match=r"3 of 7 records are missing after the merge \(first: q2, q3, q6\)"):
        first.finish(ROWS)


def test_results_made_with_other_settings_are_not_resumed(tmp_path):
    out = tmp_path / "out.jsonl"
    (job,) = processes(out, 1)
    job.same_settings({"model": "a", "sample": False})
    run([job], stop_after=1)
    (again,) = processes(out, 1)
    with pytest.raises(ValueError, match=r"other settings \(model: 'a' then, 'b' now\)"):
        again.same_settings({"model": "b", "sample": False})
    again.same_settings({"model": "a", "sample": False})  # the same settings go on
    assert again.start(ROWS, 2) and (tmp_path / "out.settings.json").is_file()
    out.unlink()  # (start merged the part into out) nothing left: any settings
    (fresh,) = processes(out, 1)
    fresh.same_settings({"model": "b"})


def test_a_finished_job_is_not_resumed_under_other_settings(tmp_path):
    """A whole output with no part beside it is a started job too: run again with another model, it is refused,
    not taken as done (every id there) under the new settings."""
    out = tmp_path / "out.jsonl"
    (job,) = processes(out, 1)
    job.same_settings({"model": "a"})
    run([job])
    (again,) = processes(out, 1)
    with pytest.raises(ValueError, match=r"other settings \(model: 'a' then, 'b' now\)"):
        again.same_settings({"model": "b"})
    assert json.loads((tmp_path / "out.settings.json").read_text(encoding="utf-8")) == {"model": "a"}


def test_the_records_redo_names_are_made_again_and_counted_in_the_status(tmp_path):
    """``redo``: output records not done after all (a failed image, a failed request) leave the output and go back
    to the batches; process 0's status counts them, the other processes' status does not."""
    out = tmp_path / "out.jsonl"
    (job,) = processes(out, 1)
    job.start(ROWS, 7)
    job.append([{"id": r["id"], "failed": i in (1, 4)} for i, r in enumerate(ROWS)])
    job.finish(ROWS)
    first, second = processes(out, 2)
    batches = [p.start(ROWS, 1, redo=lambda rec: rec["failed"]) for p in (first, second)]
    assert [[r["id"] for batch in mine for r in batch] for mine in batches] == [["q1"], ["q4"]]
    assert [rec["id"] for rec in read_jsonl(out)] == ["q0", "q2", "q3", "q5", "q6"]
    assert (
        first.status
        == f"process 0/2: 5 of 7 done in {out}, 1 to go here (2 left unfinished by the last run, done again)"
    )
    assert second.status == f"process 1/2: 5 of 7 done in {out}, 1 to go here"
    (third,) = processes(out, 1)
    assert len(third.start(ROWS, 7, redo=lambda rec: rec["failed"])[0]) == 2  # nothing more to redo
    assert third.status == f"process 0/1: 5 of 7 done in {out}, 2 to go here"


def test_an_output_process_0_cannot_read_is_an_error_naming_its_line(tmp_path):
    """What process 0 meets in merging an earlier run's output is raised from ``start``, naming the line."""
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "q0"}\nnot json\n{"id": "q1"}\n', encoding="utf-8")
    (tmp_path / "out.settings.json").write_text('{"model": "a"}', encoding="utf-8")
    (job,) = processes(out, 1)
    job.same_settings({"model": "a"})
    with pytest.raises(ValueError, match=r"out\.jsonl: line 2 is not a JSON record with an id"):
        job.start(ROWS, 2)


@pytest.mark.parametrize(
    "found,refused",
    [
        ({"out.jsonl": '{"id": "q0", "question": "?"}\n'}, True),  # another file at the path (the queries themselves)
        ({"out.jsonl": '{"id": "q0"}\n', "out.settings.json": '{"model": "a"}'}, False),  # this job's: resumed
        ({"out.jsonl.part0": '{"id": "q0"}\n'}, True),
        ({"out.jsonl": "\n"}, False),  # no record: nothing to count as done
        ({"out.jsonl": '{"id": "q0"}\n\n'}, True),  # a record, then a blank line: it holds a record
        ({}, False),
    ],
)
def test_records_without_settings_beside_them_are_not_resumed(tmp_path, found, refused):
    """Settings were compared only when a settings file existed: any JSONL at the output path had its ids counted as
    done (rl.refine --out naming its --queries file said "4 of 4 done" and refined nothing)."""
    for name, text in found.items():
        (tmp_path / name).write_text(text)
    (job,) = processes(tmp_path / "out.jsonl", 1)
    if refused:
        with pytest.raises(
            ValueError,
            match=r"out.jsonl holds records but no out.settings.json: another tool.s file, or one written before",
        ):
            job.same_settings({"model": "a"})
        assert {p.name: p.read_text() for p in tmp_path.iterdir()} == found  # nothing written or removed
    else:
        job.same_settings({"model": "a"})
        assert len(job.start(ROWS, 7)[0]) == 7 - ("out.settings.json" in found)


@pytest.mark.parametrize("name", ["out.jsonl", "refined[v2].jsonl"])
def test_records_with_unicode_line_separators_merge_and_resume(tmp_path, name):
    """JSON writes U+2028, U+2029 and U+0085 raw (ensure_ascii=False), and str.splitlines splits on them: a section
    text holding one must not cut its record in two at the merge or on resume. An output name with [ ] (a glob
    character class) finds its parts."""
    out = tmp_path / name
    rows = [{"id": f"q{i}", "text": f"line\u2028break\u0085next\u2029{i}"} for i in range(5)]
    parts = processes(out, 2)
    for p, mine in zip(parts, [p.start(rows, 2) for p in parts]):
        for batch in mine:
            p.append([dict(r, by=p.rank) for r in batch])
    assert [p.finish(rows) for p in reversed(parts)][::-1] == [True, False]
    assert [r["text"] for r in read_jsonl(out)] == [r["text"] for r in rows]
    assert [len(b) for b in processes(out, 2)[0].start(rows, 2)] == []  # all done on resume
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no part left behind


@pytest.mark.parametrize("n", [1, 2])
def test_a_repeated_id_is_refused_not_merged_away(tmp_path, n):
    """One output record per id: which of two inputs with one id survived the merge depended on the process count."""
    rows = [{"id": "x"}, {"id": "a", "q": "first"}, {"id": "a", "q": "second"}]
    with pytest.raises(ValueError, match=r"the input of .*out\.jsonl: 1 id value\(s\) occur more than once: a"):
        processes(tmp_path / "out.jsonl", n)[0].start(rows, 1)


@pytest.mark.parametrize("batch_size", [0, -1])
def test_a_batch_size_below_one_is_named(tmp_path, batch_size):
    with pytest.raises(ValueError, match=rf"the batch size must be positive, got {batch_size}"):
        processes(tmp_path / "out.jsonl", 1)[0].start(ROWS, batch_size)


@pytest.mark.parametrize("n", [1, 2])
def test_an_empty_job_leaves_an_empty_output(tmp_path, n):
    out = tmp_path / "out.jsonl"
    assert run(processes(out, n), rows=[]) == [True] + [False] * (n - 1)
    assert out.is_file() and list(read_jsonl(out)) == []


def test_outputs_that_differ_after_a_dot_keep_their_own_settings(tmp_path):
    """``refined_v1.5`` and ``refined_v1.6`` shared ``refined_v1.settings.json``: one run's settings let the other
    resume under them."""
    a, b = (processes(tmp_path / name, 1)[0] for name in ("refined_v1.5", "refined_v1.6"))
    assert a.settings_file != b.settings_file and a.settings_file.name == "refined_v1.5.settings.json"
    a.same_settings({"model": "A"})
    run([a], stop_after=1)
    b.same_settings({"model": "B"})
    with pytest.raises(ValueError, match=r"model: 'A' then, 'B' now"):
        processes(tmp_path / "refined_v1.5", 1)[0].same_settings({"model": "B"})
    assert processes(tmp_path / "out.jsonl", 1)[0].settings_file.name == "out.settings.json"  # .jsonl taken off


class OthersLate(SimpleNamespace):
    """Process 1 of 2 whose ``late``-th barrier expires as gloo reports it (the others never arrive)."""

    def __init__(self, late: int):
        super().__init__(process_index=1, num_processes=2, device="cpu", late=late, waits=0)

    def wait_for_everyone(self):
        self.waits += 1
        if self.waits == self.late:
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 3000ms for recv operation")


def test_an_expired_barrier_names_the_step_and_the_output(tmp_path):
    """A barrier past the process group's timeout says what the process waited for: the job's start (process 0's
    merge of an earlier run's parts) or its end (every process's batches), and the output; both said "after this
    step"."""
    out = tmp_path / "out.jsonl"
    with pytest.raises(TimeoutError, match=f"after process 0 merged what an earlier run left in {out} within"):
        JobParts(out, OthersLate(1)).start(ROWS, 2)
    parts = JobParts(out, OthersLate(2))
    for batch in parts.start(ROWS, 2):
        parts.append(batch)
    with pytest.raises(TimeoutError, match=f"after each process finished its batches of {out} within"):
        parts.finish(ROWS)
