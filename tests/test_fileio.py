"""Crash-safe writes (zero2all/fileio.py): old content survives failures and SIGKILL at any point, directories are
swapped whole, the fallback without an atomic swap recovers, and OS errors become one line."""

import ast
import dataclasses
import errno
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest

from zero2all import fileio
from zero2all.fileio import (
    atomic_dir,
    atomic_write,
    os_error_message,
    recover_dir,
    remove_stale_temporaries,
    replace_dir,
    save_json,
    temporary_target,
    write_bytes,
    write_text,
)

needs_fork = pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs fork to kill a child")


def _kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def _run_until_killed(target, *args):
    """Run ``target(*args)`` in a forked child that must die of SIGKILL (the kill point must be reached)."""
    p = mp.get_context("fork").Process(target=target, args=args)
    p.start()
    p.join(120)
    assert p.exitcode == -signal.SIGKILL, f"the child was not killed (exit code {p.exitcode})"


def _entries(d: Path) -> list[str]:
    return sorted(os.listdir(d))


# --------------------------------------------------------------------------------------------------------------
# files


def test_atomic_write_keeps_the_old_content_when_the_body_raises(tmp_path):
    p = write_text(tmp_path / "a.txt", "old\n")
    with pytest.raises(RuntimeError, match="half-way"):
        with atomic_write(p) as f:
            f.write("new, but never finished")
            raise RuntimeError("half-way")
    assert p.read_text() == "old\n" and _entries(tmp_path) == ["a.txt"]
    with pytest.raises(ValueError):  # a file that did not exist is not created either
        with atomic_write(tmp_path / "never.bin", "wb") as f:
            f.write(b"partial")
            raise ValueError
    assert _entries(tmp_path) == ["a.txt"]
    write_bytes(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01" and _entries(tmp_path) == ["a.txt"]
    assert oct(p.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # like open(), not mkstemp's 0o600


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_killed_at(point: str, path: str):
    if point == "replace":  # everything written and fsynced, killed just before the rename
        os.replace = lambda *a: _kill_self()
    elif point == "dir_fsync":  # killed just after the rename
        fileio.fsync_dir = lambda *a: _kill_self()
    with atomic_write(path) as f:
        f.write("new " * 1000)
        if point == "half":
            f.flush()  # half the new content reaches the temporary file
            _kill_self()
        f.write("new " * 1000)


@needs_fork
@pytest.mark.parametrize("point,expected", [("half", "old"), ("replace", "old"), ("dir_fsync", "new " * 2000)])
def test_sigkill_during_atomic_write_leaves_old_or_new_never_partial(tmp_path, point, expected):
    p = write_text(tmp_path / "state.json", "old")
    _run_until_killed(_write_killed_at, point, str(p))
    assert p.read_text() == expected
    left = [n for n in _entries(tmp_path) if n != "state.json"]
    assert all(temporary_target(n) == "state.json" for n in left)  # at most our own recognisable temporary
    assert remove_stale_temporaries(tmp_path, "state.json") == [tmp_path / n for n in left]
    assert _entries(tmp_path) == ["state.json"]


@dataclasses.dataclass
class _Inner:
    name: str = "é"
    _cache: int = 3  # private: not written


@dataclasses.dataclass
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    items: tuple = (_Inner("x"),)


def test_save_json_writes_dataclasses_as_dicts(tmp_path):
    p = save_json(_Outer(), tmp_path / "c.json")
    assert p.read_text(encoding="utf-8") == ('{\n  "inner": {\n    "name": "é"\n  },\n  "items": [\n    {\n'
                                             '      "name": "x"\n    }\n  ]\n}\n')


def test_remove_stale_temporaries_matches_only_that_name(tmp_path):
    for n in (".model.0123456789ab.tmp", ".model.safetensors.0123456789ab.tmp", ".model.tmp", "model"):
        (tmp_path / n).write_text("x")
    (tmp_path / ".model.ba9876543210.tmp").mkdir()  # a killed directory writer's leftover
    (tmp_path / ".model.ba9876543210.tmp" / "w").write_text("x")
    assert sorted(p.name for p in remove_stale_temporaries(tmp_path, "model")) == [
        ".model.0123456789ab.tmp", ".model.ba9876543210.tmp"]
    assert _entries(tmp_path) == [".model.safetensors.0123456789ab.tmp", ".model.tmp", "model"]


def test_fsync_dir_tolerates_platforms_without_directory_fsync(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "cannot open a directory")

    monkeypatch.setattr(os, "open", refuse)
    fileio.fsync_dir(tmp_path)  # no error


def test_fileio_imports_nothing_else_from_the_package():
    tree = ast.parse(Path(fileio.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.startswith("zero2all")]


# --------------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("code,hint", [(errno.ENOSPC, "; free space or choose another --out"),
                                       (errno.EROFS, "; choose a writable --out"),
                                       (errno.EACCES, "; choose a writable --out")])
def test_an_os_error_during_a_write_gives_one_line_and_keeps_the_old_file(tmp_path, monkeypatch, code, hint):
    p = write_bytes(tmp_path / "model.safetensors", b"old weights")

    def fail(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError) as info:
        write_bytes(p, b"new weights")
    monkeypatch.undo()
    line = os_error_message(info.value, p)
    if code == errno.ENOSPC:  # a full disk has its own wording
        assert line.startswith(f"disk full while writing {p} (") and line.endswith(f" bytes free); nothing was "
                                                                                f"replaced{hint}")
    else:
        assert line == f"cannot write {p}: {os.strerror(code)} (errno {code}){hint}"
    assert "\n" not in line
    assert p.read_bytes() == b"old weights" and _entries(tmp_path) == ["model.safetensors"]


# --------------------------------------------------------------------------------------------------------------
# directories


def _make_dir(path: Path, **files) -> Path:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _tree(path: Path) -> dict:
    return {p.name: p.read_text() for p in sorted(path.iterdir())}


def test_replace_dir_swaps_and_removes_the_old_copy(tmp_path, monkeypatch):
    target = _make_dir(tmp_path / "out", a="old", only_old="x")
    new = _make_dir(tmp_path / "new", a="new")
    swaps = []
    real = fileio.exchange
    monkeypatch.setattr(fileio, "exchange", lambda a, b: (swaps.append((a, b)), real(a, b)))
    try:
        replace_dir(new, target)
    except OSError as e:  # a file system without renameat2(RENAME_EXCHANGE): the fallback test covers it
        pytest.skip(f"no atomic exchange here: {e}")
    assert swaps and _tree(target) == {"a": "new"} and _entries(tmp_path) == ["out"]
    replace_dir(_make_dir(tmp_path / "first", b="1"), tmp_path / "fresh")  # no target yet: a plain rename
    assert _tree(tmp_path / "fresh") == {"b": "1"} and _entries(tmp_path) == ["fresh", "out"]


def _no_exchange(a, b):
    raise OSError(errno.EINVAL, "not supported here", str(a))


def test_replace_dir_falls_back_to_renaming_aside(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "exchange", _no_exchange)
    target = _make_dir(tmp_path / "out", a="old")
    replace_dir(_make_dir(tmp_path / "new", a="new"), target)
    assert _tree(target) == {"a": "new"} and _entries(tmp_path) == ["out"]


def _no_exchange_and_die_between_renames():
    """In a child: no atomic swap, and a kill after the fallback renamed the old version aside, before the new
    one is renamed in (the second rename)."""
    fileio.exchange = _no_exchange
    real_rename, calls = os.rename, []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == 2:
            _kill_self()
        real_rename(src, dst)

    os.rename = rename


def _replace_killed_between_renames(tmp: str, target: str):
    _no_exchange_and_die_between_renames()
    replace_dir(tmp, target)


@needs_fork
def test_the_fallback_recovers_the_old_version_after_a_kill_between_the_renames(tmp_path):
    target = _make_dir(tmp_path / "out", a="old")
    new = _make_dir(tmp_path / "new", a="new")
    _run_until_killed(_replace_killed_between_renames, str(new), str(target))
    assert not target.exists() and _tree(tmp_path / ".out.old") == {"a": "old"}  # the window the fallback has
    assert recover_dir(target) and _tree(target) == {"a": "old"} and not recover_dir(target)
    # a later writer recovers by itself, then replaces normally
    _run_until_killed(_replace_killed_between_renames, str(new), str(target))
    with atomic_dir(target) as d:
        (d / "a").write_text("newer")
    assert _tree(target) == {"a": "newer"} and _entries(tmp_path) == ["new", "out"]


def test_atomic_dir_keeps_the_old_directory_when_the_body_raises(tmp_path):
    target = _make_dir(tmp_path / "out", a="old")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as d:
            (d / "a").write_text("half")
            raise RuntimeError("failed half-way")
    assert _tree(target) == {"a": "old"} and _entries(tmp_path) == ["out"]
    with atomic_dir(target) as d:
        assert d.parent == tmp_path and temporary_target(d.name) == "out"
        (d / "b").write_text("new")
    assert _tree(target) == {"b": "new"} and _entries(tmp_path) == ["out"]


# --------------------------------------------------------------------------------------------------------------
# export_hf killed at every step over an existing export


EXPORT_KILL_POINTS = ["weights", "config", "fsync", "swap", "between_renames", "old_removal"]


def _export_killed_at(point: str, ckpt: str, out: str):
    import safetensors.torch as st
    import torch

    import zero2all.model.io as mio

    torch.set_num_threads(1)  # a forked child must not use the parent's thread pool
    if point == "weights":  # half the weights file written, then killed inside save_file
        def half_then_die(tensors, filename, metadata=None):
            data = st.save(tensors, metadata=metadata)
            with open(filename, "wb") as f:
                f.write(data[: len(data) // 2])
            _kill_self()

        st.save_file = half_then_die
    elif point == "config":
        real = mio.save_json
        mio.save_json = lambda obj, path: _kill_self() if Path(path).name == "config.json" else real(obj, path)
    elif point == "fsync":  # every file complete, nothing fsynced or renamed yet
        fileio.fsync_tree = lambda path: _kill_self()
    elif point == "swap":
        fileio.exchange = lambda a, b: _kill_self()
    elif point == "between_renames":  # no atomic swap: killed with the old export renamed aside
        _no_exchange_and_die_between_renames()
    elif point == "old_removal":  # the new export is in place; killed before the old copy is deleted
        fileio._remove = lambda path, ignore_errors=False: _kill_self()
    mio.export_hf(ckpt, out)


def _weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


@needs_fork
@pytest.mark.parametrize("point", EXPORT_KILL_POINTS)
def test_export_hf_killed_at_any_point_leaves_a_loadable_export(tmp_path, point):
    import torch
    from standin_tokenizer import tiny_model_config

    from zero2all.model.io import export_hf, load_model, save_model
    from zero2all.model.z2all import build_model

    cfg = tiny_model_config()
    old, new = build_model(cfg, seed=1), build_model(cfg, seed=2)
    save_model(old, tmp_path / "old")
    save_model(new, tmp_path / "new")
    out = export_hf(tmp_path / "old", tmp_path / "hf")
    _run_until_killed(_export_killed_at, point, str(tmp_path / "new"), str(out))

    if point == "between_renames":  # the fallback's window: the old export waits aside for recover_dir
        assert not out.exists() and recover_dir(out)
    expected = new if point == "old_removal" else old
    loaded = load_model(out)
    for k, v in _weights(expected).items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0, msg=lambda m: f"{point}: {k}: {m}")
    if point == "weights":  # and transformers reads the survivor as the Llama it was
        transformers = pytest.importorskip("transformers")
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        torch.testing.assert_close(hf.model.embed_tokens.weight, old.embed_tokens.weight, rtol=0, atol=0)

    # the next export cleans up whatever the killed one left and lands complete
    export_hf(tmp_path / "new", out)
    assert _entries(tmp_path) == ["hf", "new", "old"]
    for k, v in _weights(new).items():
        torch.testing.assert_close(load_model(out).state_dict()[k], v, rtol=0, atol=0)
