from envgen.core.files import atomic_write_text, replace_dir


def test_replace_dir_swaps_whole_folders(tmp_path):
    new, dst = tmp_path / "new", tmp_path / "dst"
    new.mkdir()
    dst.mkdir()
    (new / "a").write_text("new")
    (dst / "a").write_text("old")
    replace_dir(new, dst)
    assert (dst / "a").read_text() == "new" and not new.exists() and [p.name for p in tmp_path.iterdir()] == ["dst"]


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    atomic_write_text(tmp_path / "sub" / "f.txt", "x")
    assert (tmp_path / "sub" / "f.txt").read_text() == "x" and [p.name for p in (tmp_path / "sub").iterdir()] == ["f.txt"]


def test_what_a_killed_replace_or_write_left_is_put_right_on_the_next_run(tmp_path):
    """Killed between replace_dir's two moves: the old folder sits aside and nothing is at the destination; the next
    replace (or recover_dir) puts it back first. A killed write's temporary file goes once it is stale."""
    import os
    import time

    from envgen.core.files import STALE_TMP_SECONDS, recover_dir

    dst = tmp_path / "adapter"
    aside = tmp_path / ".adapter.old-12345"
    aside.mkdir()
    (aside / "weights").write_text("old")
    recover_dir(dst)
    assert (dst / "weights").read_text() == "old" and not aside.exists()
    aside.mkdir()  # a second leftover while the destination exists: removed
    new = tmp_path / "new"
    new.mkdir()
    (new / "weights").write_text("new")
    replace_dir(new, dst)
    assert (dst / "weights").read_text() == "new" and not aside.exists()
    stale, fresh = tmp_path / ".f.txt.abc.tmp", tmp_path / ".f.txt.def.tmp"
    stale.write_text("half")
    fresh.write_text("being written by another process")
    old = time.time() - STALE_TMP_SECONDS - 1
    os.utime(stale, (old, old))
    atomic_write_text(tmp_path / "f.txt", "whole")
    assert (tmp_path / "f.txt").read_text() == "whole" and not stale.exists() and fresh.exists()


def test_bounded_reads_refuse_what_is_not_a_regular_file_or_too_large(tmp_path):
    import pytest

    from envgen.core.files import InputFileError, read_json, read_text_bounded

    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(InputFileError, match="larger than 100 bytes"):
        read_text_bounded(tmp_path / "big", 100)
    with pytest.raises(InputFileError, match="not a regular file"):
        read_text_bounded(tmp_path, 100)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InputFileError, match="nested too deep"):
        read_json(tmp_path / "deep.json")
    with pytest.raises(InputFileError, match="cannot be read"):
        read_json(tmp_path / "missing.json")
