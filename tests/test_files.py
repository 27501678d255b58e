"""common.files' helpers: a folder written under a temporary name and renamed (over an old one, or keeping the one
another process renamed first), a bounded wait for a path another process writes, atomic files' permissions, and the
resume of a JSONL file an interrupted job appended to."""

import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest

import common.files as files
from common.files import (
    append_jsonl,
    atomic_folder,
    atomic_path,
    check_unique_ids,
    completed_ids,
    file_fingerprint,
    read_jsonl,
    readable_records,
    repair_jsonl,
    replace_folder,
    wait_for_path,
    weights_fingerprint,
    without_lone_surrogates,
    write_json_atomic,
    write_jsonl_atomic,
    write_text_atomic,
)


@pytest.mark.parametrize("replace", [True, False])
def test_a_finished_folder_is_renamed_into_place_and_no_temporary_is_left(tmp_path, replace):
    with atomic_folder(tmp_path / "model", replace=replace) as tmp:
        assert tmp.is_dir() and tmp.parent == tmp_path and not list(tmp.iterdir())
        (tmp / "config.json").write_text("new")
    assert (tmp_path / "model" / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("replace,kept", [(True, "new"), (False, "first")])
def test_an_existing_folder_is_replaced_or_kept(tmp_path, replace, kept):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("first")  # another process finished first
    with atomic_folder(tmp_path / "model", replace=replace) as tmp:
        (tmp / "config.json").write_text("new")
    assert (tmp_path / "model" / "config.json").read_text() == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failed_block_leaves_neither_folder_nor_temporary(tmp_path):
    with pytest.raises(RuntimeError, match="crashed"), atomic_folder(tmp_path / "model") as tmp:
        (tmp / "half.safetensors").write_text("x")
        raise RuntimeError("crashed")
    assert not list(tmp_path.iterdir())


def test_a_failed_block_leaves_the_old_folder_as_it_was(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("old")
    with pytest.raises(RuntimeError), atomic_folder(tmp_path / "model") as tmp:
        (tmp / "config.json").write_text("new")
        raise RuntimeError("crashed")
    assert (tmp_path / "model" / "config.json").read_text() == "old"


def test_a_crashed_runs_leftovers_under_this_process_id_do_not_cost_the_new_folder(tmp_path):
    """A crash leaves its temporary and set-aside folders; with names from the process id, a later process with the
    same id (containers reuse them) could not set the old folder aside after its work was done, and deleted its own
    new folder."""
    import os

    for kind in ("tmp", "old"):
        (tmp_path / f".model.{kind}-{os.getpid()}").mkdir()
        (tmp_path / f".model.{kind}-{os.getpid()}" / "config.json").write_text("crashed run's")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("old")
    with atomic_folder(tmp_path / "model") as tmp:
        (tmp / "config.json").write_text("new")
    assert (tmp_path / "model" / "config.json").read_text() == "new"
    assert oct((tmp_path / "model").stat().st_mode & 0o777) == oct(0o777 & ~current_umask())  # not the owner's only


def current_umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_waiting_for_a_path_returns_it_once_there_and_names_what_it_waited_for_if_not(tmp_path):
    (tmp_path / "done").write_text("")
    assert wait_for_path(tmp_path / "done", 0, "x") == tmp_path / "done"
    with pytest.raises(TimeoutError, match=r"missing did not appear within 0 s: waiting for process 0 to build it"):
        wait_for_path(tmp_path / "missing", 0, "process 0 to build it")


class FakeClock:
    """``time`` for ``common.files``: each sleep moves the clock 0.5 s on and runs ``on_sleep`` (another process at
    work); a loop that reads the clock without ever sleeping fails instead of spinning."""

    def __init__(self, on_sleep=lambda slept: None):
        self.now, self.slept, self.reads, self.on_sleep = 0.0, [], 0, on_sleep

    def monotonic(self):
        self.reads += 1
        assert self.reads < 100, "the wait reads the clock without sleeping"
        return self.now

    def sleep(self, s):
        self.slept.append(s)
        self.now += 0.5
        self.on_sleep(len(self.slept))


def test_a_wait_polls_until_the_path_appears(tmp_path, monkeypatch):
    done = tmp_path / "done"
    clock = FakeClock(on_sleep=lambda n: n == 3 and done.write_text(""))  # written during the third sleep
    monkeypatch.setattr(files, "time", clock)
    assert wait_for_path(done, 10, "x") == done
    assert clock.slept == [0.1] * 3


def test_a_wait_gives_up_no_sooner_than_its_timeout_and_within_one_poll_after(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(files, "time", clock)
    with pytest.raises(TimeoutError, match="missing did not appear within 1 s: waiting for process 0"):
        wait_for_path(tmp_path / "missing", 1.0, "process 0")
    assert 1.0 <= clock.now <= 1.5


@pytest.fixture
def umask_027():
    """The process's umask set to 0o027 for the test (``common.files`` reads it once: that reading is cleared)."""
    files._umask.cache_clear()
    before = os.umask(0o027)
    yield
    os.umask(before)
    files._umask.cache_clear()


def test_atomic_writes_follow_the_umask_and_leave_it_as_it_was(tmp_path, umask_027):
    """An atomic file and folder get what ``open`` and ``mkdir`` would give them under the process's umask, and
    reading the umask (which means setting it) puts it back: later files are not more open than asked."""
    write_text_atomic(tmp_path / "out.txt", "x")
    with atomic_folder(tmp_path / "model") as tmp:
        (tmp / "config.json").write_text("{}")
    assert stat.S_IMODE((tmp_path / "out.txt").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == 0o750
    assert current_umask() == 0o027


def test_an_atomic_file_gets_an_ordinary_files_permissions(tmp_path):
    """mkstemp makes owner-only files; a file written atomically is readable as one written with open()."""
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    write_text_atomic(tmp_path / "atomic.txt", "x")
    assert stat.S_IMODE((tmp_path / "atomic.txt").stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
    assert stat.S_IMODE(plain.stat().st_mode) & stat.S_IROTH  # the default umask lets others read


@pytest.mark.parametrize(
    "text,ids,after",
    [
        ('{"id": "a"}\n{"id": "b"}', {"a", "b"}, '{"id": "a"}\n{"id": "b"}\n'),  # whole, no newline: one added
        ('{"id": "a"}\n{"id": "b', {"a"}, '{"id": "a"}\n'),  # cut short: dropped
        ('{"id": "a"}\n', {"a"}, '{"id": "a"}\n'),
        ("", set(), ""),
        ('{"id": "a", "t": "x\u2028y\u0085z"}\n', {"a"}, '{"id": "a", "t": "x\u2028y\u0085z"}\n'),  # raw, one line
    ],
)
def test_the_next_append_after_a_resume_starts_its_own_line(tmp_path, text, ids, after):
    out = tmp_path / "out.jsonl"
    out.write_text(text)
    assert completed_ids(out) == ids
    assert out.read_text() == after
    append_jsonl(out, [{"id": "c"}])
    assert completed_ids(out) == ids | {"c"}


def test_a_last_line_cut_inside_a_character_is_dropped_like_any_cut_line(tmp_path):
    """A write stopped short (a full disk) can end mid-character: that last line is dropped, not the file refused."""
    out = tmp_path / "out.jsonl"
    out.write_bytes('{"id": "a", "title": "Zürich"}\n{"id": "b", "title": "K'.encode() + "ö".encode()[:1])
    assert completed_ids(out) == {"a"} and out.read_text() == '{"id": "a", "title": "Zürich"}\n'


def test_replacing_a_folder_never_leaves_it_half_deleted(tmp_path, monkeypatch):
    """The old folder is moved aside before the new one is renamed in, and deleted after: a crash while deleting
    leaves the new folder whole at the target (here the deletion of the old one fails midway)."""
    import shutil

    (tmp_path / "model").mkdir()
    for i in range(5):
        (tmp_path / "model" / f"shard{i}").write_text("old")
    real = shutil.rmtree

    def crash_in_old(path, *a, **k):
        old = [f for f in Path(path).glob("shard*") if f.read_text() == "old"]
        if old:  # the process dies while deleting the old copy, two files in
            old[0].unlink(), old[1].unlink()
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", crash_in_old)
    with pytest.raises(KeyboardInterrupt), atomic_folder(tmp_path / "model") as tmp:
        for i in range(3):
            (tmp / f"shard{i}").write_text("new")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["shard0", "shard1", "shard2"]
    assert {p.read_text() for p in (tmp_path / "model").iterdir()} == {"new"}


def test_an_atomic_file_is_on_disk_before_its_name_points_at_it(tmp_path, monkeypatch):
    """fsync of the file before the rename, of the folder after: a power loss never leaves the name on an empty
    file (a filesystem that does not flush data on rename: XFS, network file systems)."""
    import os

    import common.files as files

    events = []
    real_replace = os.replace
    monkeypatch.setattr(files.os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))))
    monkeypatch.setattr(files.os, "replace", lambda a, b: events.append(("replace", str(b))) or real_replace(a, b))
    write_text_atomic(tmp_path / "out.json", "{}")
    (fsync_file, name), (replace, target), (fsync_dir, folder) = events
    assert (fsync_file, replace, fsync_dir) == ("fsync", "replace", "fsync")
    assert Path(name).parent == tmp_path and Path(name).name.startswith(".out.json.")  # the temporary, before
    assert target == str(tmp_path / "out.json") and folder == str(tmp_path)


def test_jsonl_files_are_utf8_whatever_the_locale(tmp_path):
    """Written and read as UTF-8 under an ASCII locale too (``repair_jsonl`` decodes UTF-8): "Zürich" was an
    encoding error there, and under a Latin-1 locale a finished record read as a line cut short."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from common.files import *\n"
        "p = Path(sys.argv[1])\n"
        "z = 'Z\\u00fcrich'\n"  # the command line itself in ASCII
        "append_jsonl(p, [{'id': 'q1', 'city': z}]); write_text_atomic(p.with_suffix('.txt'), z)\n"
        "print(ascii([r['city'] for r in repair_jsonl(p, key='id')] + [r['city'] for r in read_jsonl(p)]))"
    )
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "a.jsonl")],
        env=env,
        capture_output=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr.decode()[-800:]
    assert done.stdout.decode().strip() == ascii(["Zürich", "Zürich"])
    assert (tmp_path / "a.txt").read_bytes() == "Zürich".encode()


def test_a_record_holding_a_lone_surrogate_is_written_escaped_and_read_back_as_a_replacement(tmp_path):
    """JSON read from elsewhere (a server's reply) can hold half a surrogate pair: writing it raised
    UnicodeEncodeError, ending the job; it is escaped, and read back as U+FFFD; other text stays unescaped."""
    rec = {"id": "q1", "text": "cut \ud83d", "city": "Zürich"}
    append_jsonl(tmp_path / "a.jsonl", [rec])
    write_jsonl_atomic(tmp_path / "b.jsonl", [rec, {"id": "q2", "city": "Zürich"}])
    write_json_atomic(tmp_path / "c.json", rec)
    for name in ("a.jsonl", "b.jsonl"):
        first = next(read_jsonl(tmp_path / name))
        assert first == {"id": "q1", "text": "cut \ufffd", "city": "Zürich"}
    assert "Zürich" in (tmp_path / "b.jsonl").read_text(encoding="utf-8").splitlines()[1]  # only that line escaped
    assert "\\ud83d" in (tmp_path / "c.json").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "value,kept",
    [
        ("cut \ud83d", "cut \ufffd"),
        ({"k\udc00": ["x\ud800", 1, None, {"y": "\udfff"}]}, {"k\ufffd": ["x\ufffd", 1, None, {"y": "\ufffd"}]}),
        ([3, 1.5, True], [3, 1.5, True]),
        ("Zürich \U0001f600", "Zürich \U0001f600"),
    ],
)
def test_lone_surrogates_become_replacement_characters_at_any_depth(value, kept):
    assert without_lone_surrogates(value) == kept


def test_json_is_written_indented_and_jsonl_one_record_a_line_counted(tmp_path):
    write_json_atomic(tmp_path / "a.json", {"a": [1]})
    assert (tmp_path / "a.json").read_text() == '{\n  "a": [\n    1\n  ]\n}\n'
    assert write_jsonl_atomic(tmp_path / "b.jsonl", (r for r in [{"a": 1}, {"b": "ü"}])) == 2
    assert (tmp_path / "b.jsonl").read_text(encoding="utf-8") == '{"a": 1}\n{"b": "ü"}\n'


@pytest.mark.parametrize(
    "lines,required,what,error",
    [
        (['{"id": 1, "question": "q"}'], ("id", "question"), None, None),
        (['{"id": 1}', "", '{"question": "q"}'], ("id",), None, ':3 lacks "id"'),  # a blank line still counts
        (['{"id": 1, "question": null}'], ("id", "question"), None, ':1 has null for "question"'),
        (['{"id": 1, "question": ""}'], ("question",), None, None),  # empty is the reader's to judge, not missing
        (['{"id": 1}'], ("prompt",), "not a rendered file", ':1 lacks "prompt": not a rendered file'),
        (['{"id": 1}'], (), None, None),
        (['{"id": 1}', '["id"]'], (), None, ":2: expected a JSON object, got list"),
        (['{"id": 1'], (), None, ":1: not valid JSON (Expecting ',' delimiter)"),
    ],
)
def test_read_jsonl_names_the_line_and_field_a_record_lacks(tmp_path, lines, required, what, error):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(lines) + "\n")
    if error is None:
        assert len(list(read_jsonl(path, required, what))) == sum(bool(x) for x in lines)
    else:
        with pytest.raises(ValueError, match=f"^{re.escape(str(path) + error)}$"):
            list(read_jsonl(path, required, what))


def test_a_figure_that_cannot_be_written_is_closed_all_the_same(tmp_path):
    """pyplot keeps every open figure until it is closed: a plot whose save failed (a full disk, a bad path) stayed
    open for the rest of a long job."""
    from common.files import pyplot, save_figure

    plt = pyplot()
    fig, _ = plt.subplots()
    (tmp_path / "not_a_folder").write_text("x", encoding="utf-8")
    with pytest.raises(OSError):
        save_figure(fig, tmp_path / "not_a_folder" / "plot.png")
    assert fig.number not in plt.get_fignums()
    assert not list(tmp_path.glob("**/*.png"))


@pytest.mark.parametrize("kind", [str, Path])
def test_atomic_writes_take_a_str_or_a_path_and_make_the_missing_folders(tmp_path, kind):
    write_text_atomic(kind(tmp_path / "a" / "b" / "out.txt"), "x")
    append_jsonl(kind(tmp_path / "f" / "g" / "out.jsonl"), [{"id": "a"}])
    assert repair_jsonl(kind(tmp_path / "f" / "g" / "out.jsonl")) == [{"id": "a"}]
    assert repair_jsonl(kind(tmp_path / "missing.jsonl")) == []
    with atomic_folder(kind(tmp_path / "c" / "d" / "model")) as tmp:
        (tmp / "config.json").write_text("new")
    (tmp_path / "e").mkdir()
    replace_folder(kind(tmp_path / "e"), kind(tmp_path / "c" / "d" / "model"))
    assert (tmp_path / "a" / "b" / "out.txt").read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "c" / "d").iterdir()) == ["model"]
    assert not list((tmp_path / "c" / "d" / "model").iterdir())  # the empty folder renamed over it


@pytest.mark.parametrize("suffix,ends", [("", ".tmp"), (".npy", ".npy")])
def test_the_temporary_lies_beside_the_target_and_ends_with_the_suffix_asked_for(tmp_path, suffix, ends):
    with atomic_path(tmp_path / "out.bin", suffix=suffix) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.bin.") and tmp.suffix == ends


def test_an_array_written_with_np_save_lands_at_the_target(tmp_path):
    """np.save adds ".npy" to a name without it: the array went beside the temporary, and the empty temporary was
    renamed into place (``retrieval.build_shards`` asks for the suffix)."""
    with atomic_path(tmp_path / "shard.npy", suffix=".npy") as tmp:
        np.save(tmp, np.arange(3))
    assert np.load(tmp_path / "shard.npy").tolist() == [0, 1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["shard.npy"]


def open_under(folder: Path) -> list[str]:
    """What this process's open file descriptors point at inside ``folder`` (the folder itself included)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor os.listdir itself used, closed since
            pass
    return [t for t in targets if t == str(folder) or t.startswith(f"{folder}/")]


def test_atomic_writes_leave_no_file_descriptor_open(tmp_path):
    for i in range(3):
        write_text_atomic(tmp_path / f"out{i}.txt", "x")
    assert open_under(tmp_path) == []


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    (tmp_path / "out.txt").write_text("old")
    with pytest.raises(RuntimeError, match="crashed"), atomic_path(tmp_path / "out.txt") as tmp:
        tmp.write_text("half")
        raise RuntimeError("crashed")
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    assert (tmp_path / "out.txt").read_text() == "old"


def test_keeping_a_first_finished_folder_does_not_hide_another_failure(tmp_path):
    """With ``replace=False`` a failed rename is taken for another process's finished folder only when a folder is
    there: a file in its place is an error, not finished work silently thrown away."""
    (tmp_path / "model").write_text("not a folder")
    with pytest.raises(NotADirectoryError), atomic_folder(tmp_path / "model", replace=False) as tmp:
        (tmp / "config.json").write_text("new")
    assert (tmp_path / "model").read_text() == "not a folder"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.mark.parametrize(
    "text,key,records,error",
    [
        ('{"id": "a"}\n{"id": "b"}\n{"id": "c', "id", ["a", "b"], None),  # the last line cut: only it dropped
        ('{"id": "a"}\n[1]\n{"id": "b"}\n', "id", None, "line 2 is not a JSON record with an id"),
        ('{"id": "a"}\n{"x": 1}\n{"id": "b"}\n', "id", None, "line 2 is not a JSON record with an id"),
        ('{"x": 1}\n{"id": "a"}\n{"x": 2}\n', "x", None, "line 2 is not a JSON record with a x"),
        ('{"x": 1}\n[1]\n{"id": "a"}\n', None, None, "line 2 is not a JSON record;"),
        ('{"x": 1}\n{"id": "a"}\n', None, [None, "a"], None),
    ],
)
def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path, text, key, records, error):
    path = tmp_path / "out.jsonl"
    path.write_text(text)
    if error:
        with pytest.raises(ValueError, match=re.escape(f"{path}: {error}")):
            repair_jsonl(path, key=key)
        assert path.read_text() == text
    else:
        assert [r.get("id") for r in repair_jsonl(path, key=key)] == records
        assert path.read_text() == "".join(text.splitlines(keepends=True)[: len(records)])  # the cut line only


def test_readable_records_pass_over_any_line_that_is_not_an_object(tmp_path):
    (tmp_path / "log.jsonl").write_text('{"a": 1}\n{"b"\n[1]\n"x"\n\n{"c": 2}\n')
    assert readable_records(tmp_path / "log.jsonl") == [{"a": 1}, {"c": 2}]


def test_fingerprints_of_a_file_and_of_a_models_weights(tmp_path):
    import hashlib

    (tmp_path / "a.bin").write_bytes(b"abc")
    assert file_fingerprint(tmp_path / "a.bin") == "sha256:" + hashlib.sha256(b"abc").hexdigest()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert weights_fingerprint(model) is None  # no weights file
    (model / "model.safetensors").write_bytes(b"w" * 8)
    first = weights_fingerprint(model)
    assert re.fullmatch("[0-9a-f]{24}", first)
    (model / "config.json").write_text('{"x": 1}')
    (model / "extra.bin").mkdir()  # a folder, not a weights file
    assert weights_fingerprint(model) == first
    (model / "model.safetensors").write_bytes(b"w" * 9)  # the size tells it apart, whatever the clock's resolution
    assert weights_fingerprint(model) != first


@pytest.mark.parametrize(
    "ids,shown,error",
    [
        (["a", "b", "c"], 10, None),
        (["a", "b", "a", "b", "a"], 10, "2 id value(s) occur more than once: a, b (ids must be unique)"),
        (["b", "a", "a", "b"], 2, "2 id value(s) occur more than once: a, b (ids"),  # all shown, no ellipsis
        (["a", "b", "a", "b"], 1, "2 id value(s) occur more than once: a … (ids"),
    ],
)
def test_duplicate_ids_are_named_first_ones_first(ids, shown, error):
    rows = [{"id": i} for i in ids]
    if error is None:
        check_unique_ids(rows, "q.jsonl", shown=shown)
    else:
        with pytest.raises(ValueError, match=re.escape(f"q.jsonl: {error}")):
            check_unique_ids(rows, "q.jsonl", shown=shown)


def test_a_figure_is_written_as_png_on_the_agg_backend(tmp_path):
    import matplotlib

    from common.files import pyplot, save_figure

    matplotlib.use("svg")
    plt = pyplot()
    assert matplotlib.get_backend().lower() == "agg"
    fig, _ = plt.subplots()
    save_figure(fig, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]
