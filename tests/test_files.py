"""common.files' helpers: a folder written under a temporary name and renamed (over an old one, or keeping the one
another process renamed first), a bounded wait for a path another process writes, atomic files' permissions, and the
resume of a JSONL file an interrupted job appended to."""

import stat

import pytest

from common.files import append_jsonl, atomic_folder, completed_ids, wait_for_path, write_text_atomic


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
    ],
)
def test_the_next_append_after_a_resume_starts_its_own_line(tmp_path, text, ids, after):
    out = tmp_path / "out.jsonl"
    out.write_text(text)
    assert completed_ids(out) == ids
    assert out.read_text() == after
    append_jsonl(out, [{"id": "c"}])
    assert completed_ids(out) == ids | {"c"}
