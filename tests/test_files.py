"""common.files' folder helpers: a folder written under a temporary name and renamed (over an old one, or keeping the
one another process renamed first), and a bounded wait for a path another process writes."""

import pytest

from common.files import atomic_folder, wait_for_path


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
