from envgen.files import atomic_write_text, replace_dir


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
