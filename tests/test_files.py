"""common.files' helpers: a folder written under a temporary name and renamed (over an old one, or keeping the one
another process renamed first), a bounded wait for a path another process writes, atomic files' permissions, and the
resume of a JSONL file an interrupted job appended to."""

import re
import stat
from pathlib import Path

import pytest

from common.files import (
    append_jsonl,
    atomic_folder,
    completed_ids,
    read_jsonl,
    wait_for_path,
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
    "lines,required,what,error",
    [
        (['{"id": 1, "question": "q"}'], ("id", "question"), None, None),
        (['{"id": 1}', "", '{"question": "q"}'], ("id",), None, ':3 lacks "id"'),  # a blank line still counts
        (['{"id": 1, "question": null}'], ("id", "question"), None, ':1 has null for "question"'),
        (['{"id": 1, "question": ""}'], ("question",), None, None),  # empty is the reader's to judge, not missing
        (['{"id": 1}'], ("prompt",), "not a rendered file", ':1 lacks "prompt": not a rendered file'),
        (['{"id": 1}'], (), None, None),
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
