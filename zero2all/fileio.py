"""Crash-safe writes: whatever is written appears complete under its final name, or not at all.

Every output of the project (configs, checkpoints, exports, tokenizers, token shards, reports) goes through this
module. The rule is the same for files and directories: write under a temporary name beside the target, flush it
to disk, then rename it onto the target. ``rename`` is atomic within a file system, so a process killed at any
moment (``kill -9``, out of memory, a node lost) leaves either the old version or the new one under the name, never
a mixture and never nothing.

Files::

    with atomic_write("runs/x/report.md") as f:      # f writes .report.md.<random>.tmp
        f.write(text)                                 # on success: fsync, rename onto report.md, fsync the folder
    write_text(path, text); write_bytes(path, data); save_json(obj, path)

Directories::

    with atomic_dir("runs/x/hf") as tmp:             # tmp is a fresh .hf.<random>.tmp beside it
        ...write files into tmp...                   # on success: fsync all, then replace_dir(tmp, "runs/x/hf")

A directory cannot be renamed over a non-empty one, so :func:`replace_dir` swaps the two atomically on Linux
(``renameat2(RENAME_EXCHANGE)``) and deletes the old one afterwards. Where the swap is unavailable it renames the
old one aside (``.NAME.old``) first; :func:`recover_dir` puts it back if a kill came between the two renames.

Temporaries are named ``.NAME.<12 hex digits>.tmp``: hidden, unique per writer, and recognisable, so that a writer
can delete the leftovers of a killed predecessor (:func:`remove_stale_temporaries`). That assumes one writer per
target at a time, which holds for every output here (a run directory belongs to one run).

This module imports nothing else from the package, so anything may use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import os
import re
import secrets
import shutil
import stat
import sys
from pathlib import Path
from typing import IO, Any, Iterator

_TAG_HEX_DIGITS = 12  # 48 random bits: a collision between two live writers of one name is not a concern
TEMPORARY_NAME = re.compile(rf"^\.(?P<name>.+)\.(?P<tag>[0-9a-f]{{{_TAG_HEX_DIGITS}}})\.tmp$")
"""A temporary's file name; group ``name`` is the name of the target it will become."""

_FILE_MODES = ("w", "wb")


# --------------------------------------------------------------------------------------------------------------
# names


def temporary_path(target: str | os.PathLike) -> Path:
    """A fresh temporary name beside ``target``: ``.NAME.<random>.tmp`` (not created)."""
    target = Path(target)
    return target.with_name(f".{target.name}.{secrets.token_hex(_TAG_HEX_DIGITS // 2)}.tmp")


def temporary_target(file_name: str) -> str | None:
    """The target name that temporary ``file_name`` was written for, or None when it is not one of ours."""
    m = TEMPORARY_NAME.match(file_name)
    return m.group("name") if m else None


def aside_path(target: str | os.PathLike) -> Path:
    """Where :func:`replace_dir`'s fallback keeps the old ``target`` while the new one is renamed in."""
    target = Path(target)
    return target.with_name(f".{target.name}.old")


def remove_stale_temporaries(directory: str | os.PathLike, name: str) -> list[Path]:
    """Delete the temporaries ``.NAME.<random>.tmp`` (files or directories) that killed writers of ``name`` left in
    ``directory``; returns what was removed. Call it before writing ``name``, never while another process does."""
    directory = Path(directory)
    removed = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if temporary_target(entry.name) == name:
            _remove(Path(entry.path))
            removed.append(Path(entry.path))
    return removed


# --------------------------------------------------------------------------------------------------------------
# fsync


# Errors that mean "this platform or file system cannot fsync a directory", not "the data is not on disk":
# Windows cannot open a directory at all, some network and FUSE file systems refuse fsync on one.
_NO_DIR_FSYNC = {errno.EINVAL, errno.EBADF, errno.EACCES, errno.EPERM, errno.EISDIR,
                 getattr(errno, "ENOTSUP", errno.EINVAL), getattr(errno, "EOPNOTSUPP", errno.EINVAL)}


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (the result of a rename or a create) to disk. A no-op where the platform or file
    system cannot fsync directories; real I/O errors (EIO, ENOSPC) are raised."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        if e.errno in _NO_DIR_FSYNC or sys.platform == "win32":
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data to disk. Opened read-only on POSIX (fsync applies to the file, whichever descriptor
    asks); Windows flushes only through a descriptor open for writing."""
    fd = os.open(path, os.O_RDWR | getattr(os, "O_BINARY", 0) if sys.platform == "win32" else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under ``path`` (and ``path`` itself), children before their parent, so that a
    rename of ``path`` that reaches the disk finds complete contents. Symbolic links are not followed."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        if not path.is_symlink():
            fsync_file(path)
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            f = os.path.join(root, name)
            if not os.path.islink(f):
                fsync_file(f)
        fsync_dir(root)


# --------------------------------------------------------------------------------------------------------------
# files


class AtomicFile:
    """A file written under a temporary name beside ``path``; :meth:`commit` puts it at ``path``, :meth:`discard`
    deletes it. For writers that keep a file open across calls (a token shard growing chunk by chunk); everyone
    else uses :func:`atomic_write`.

    The temporary is created with the permissions ``open()`` would give a new file (0o666 less the umask), so the
    result is not the owner-only 0o600 of ``tempfile.mkstemp``.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "w", encoding: str = "utf-8"):
        if mode not in _FILE_MODES:
            raise ValueError(f"{path}: mode {mode!r} is not one of {', '.join(_FILE_MODES)}")
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        while True:
            self.tmp = temporary_path(self.path)
            try:
                fd = os.open(self.tmp, flags, 0o666)
                break
            except FileExistsError:  # another writer drew the same 48 bits: draw again
                continue
        try:
            # newline="\n": the same bytes on every platform
            kwargs = {} if "b" in mode else {"encoding": encoding, "newline": "\n"}
            self.file: IO = os.fdopen(fd, mode, **kwargs)
        except BaseException:
            os.close(fd)
            self.tmp.unlink(missing_ok=True)
            raise
        self.closed = False

    def commit(self) -> Path:
        """Flush and fsync the data, rename the temporary onto ``path``, fsync the directory; returns ``path``.
        On failure the temporary is deleted and ``path`` keeps its old content."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        self.closed = True
        fsync_dir(self.path.parent)
        return self.path

    def discard(self) -> None:
        """Close and delete the temporary; ``path`` is left as it was."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str = "utf-8") -> Iterator[IO]:
    """Write ``path`` through a file object on a temporary beside it (``.NAME.<random>.tmp``).

    On normal exit the data is fsynced and renamed onto ``path`` (then the directory fsynced); if the block raises,
    the temporary is deleted, ``path`` keeps its old content and the exception propagates. ``mode``: "w" (text,
    ``encoding``, "\\n" line ends) or "wb". The directory must exist.
    """
    f = AtomicFile(path, mode, encoding)
    try:
        yield f.file
    except BaseException:
        f.discard()
        raise
    f.commit()


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically; returns ``path``."""
    with atomic_write(path, "w", encoding) as f:
        f.write(text)
    return Path(path)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns ``path``."""
    with atomic_write(path, "wb") as f:
        f.write(data)
    return Path(path)


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy the contents of ``src`` to ``dst`` atomically (permission bits copied too); returns ``dst``."""
    out = AtomicFile(dst, "wb")
    try:
        with open(src, "rb") as fin:
            shutil.copyfileobj(fin, out.file, 1 << 20)
        os.chmod(out.tmp, stat.S_IMODE(os.stat(src).st_mode))
    except BaseException:
        out.discard()
        raise
    return out.commit()


def default_file_mode() -> int:
    """The permissions a new file gets from ``open()``: 0o666 less the process's umask. Read from /proc where it is
    (setting the umask to read it back would change it for every thread meanwhile)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
    """``safetensors.torch.save_file`` with the permissions of any other output: the library creates its file
    owner-only (0o600), which would leave the weights unreadable to the group and others that can read the config
    beside them. ``path`` is normally inside a temporary directory (:func:`atomic_dir`)."""
    from safetensors.torch import save_file

    save_file(tensors, os.fspath(path), metadata=metadata)
    os.chmod(path, default_file_mode())
    return Path(path)


def to_jsonable(obj: Any) -> Any:
    """Dataclasses become dicts (fields named ``_...`` are private and left out), recursively through dicts,
    lists and tuples; everything else is returned as is."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not f.name.startswith("_")}
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


def save_json(obj: Any, path: str | os.PathLike) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically: dataclasses as dicts, non-ASCII as is, indent 2, a final
    newline. Returns ``path``."""
    text = json.dumps(to_jsonable(obj), indent=2, ensure_ascii=False) + "\n"
    return write_text(path, text)


# --------------------------------------------------------------------------------------------------------------
# directories


_RENAME_EXCHANGE = 2  # linux/fs.h: swap the two names
_AT_FDCWD = -100  # relative paths resolve against the working directory, as os.rename's do
# Answers of renameat2 that mean "no atomic swap here" (old kernel, old libc, a file system without it):
# fall back to renaming aside rather than failing the write.
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, getattr(errno, "ENOTSUP", errno.EINVAL),
                getattr(errno, "EOPNOTSUPP", errno.EINVAL)}
_renameat2 = None


def _libc_renameat2():
    global _renameat2
    if _renameat2 is None:
        func = False
        if sys.platform.startswith("linux"):
            try:
                func = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
                func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                func.restype = ctypes.c_int
            except (OSError, AttributeError):
                func = False
        _renameat2 = func
    return _renameat2 or None


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """Swap the names ``a`` and ``b`` (files or directories, both existing) in one atomic step: Linux
    ``renameat2(RENAME_EXCHANGE)``. Raises OSError(ENOSYS) where there is no such call, and the call's error
    (EINVAL where the file system does not support it) otherwise."""
    func = _libc_renameat2()
    if func is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(a), None, str(b))
    if func(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def recover_dir(target: str | os.PathLike) -> bool:
    """Put back the old version of ``target`` if a writer was killed after renaming it aside (``.NAME.old``) and
    before renaming the new one in. Returns True when it did. Readers may call it before opening ``target``."""
    target = Path(target)
    old = aside_path(target)
    if os.path.lexists(old) and not os.path.lexists(target):
        os.rename(old, target)
        fsync_dir(target.parent)
        return True
    return False


def replace_dir(tmp: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Put the finished directory ``tmp`` at ``target`` (same file system), replacing an existing ``target``, such
    that a complete version is always found at ``target`` (or, in the fallback, restored by :func:`recover_dir`).

    With an atomic swap (Linux) the two are exchanged, then the old version, now under ``tmp``'s name, is deleted.
    Without one, the old version is renamed aside to ``.NAME.old``, ``tmp`` renamed in, and the aside deleted.
    Either way a failure to delete the old version leaves a leftover, not an error: the new one is in place.
    """
    tmp, target = Path(tmp), Path(target)
    recover_dir(target)
    if not os.path.lexists(target):
        os.rename(tmp, target)
        fsync_dir(target.parent)
        return target
    try:
        exchange(tmp, target)
    except OSError as e:
        if e.errno not in _NO_EXCHANGE:
            raise
        _replace_by_renaming_aside(tmp, target)
    else:
        fsync_dir(target.parent)
        _remove(tmp, ignore_errors=True)  # the old version, now under the temporary name
    return target


def _replace_by_renaming_aside(tmp: Path, target: Path) -> None:
    old = aside_path(target)
    if os.path.lexists(old):  # target exists (recover_dir ran), so this is a finished writer's leftover
        _remove(old)
    os.rename(target, old)
    # a kill here leaves no target: recover_dir (run by the next writer, or a reader) renames old back
    try:
        os.rename(tmp, target)
    except BaseException:
        recover_dir(target)  # a failure (not a kill) puts the old version straight back
        raise
    fsync_dir(target.parent)
    _remove(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, kind: str | None = None) -> Iterator[Path]:
    """Build a directory under a temporary name beside ``target`` (``.NAME.<random>.tmp``) and put it at ``target``
    when the block completes. ``kind``: mark the result as an output of that kind (:func:`write_output_marker`,
    listing what the block wrote), so that a later writer of the same kind recognises it
    (:func:`claim_output_dir`).

    On normal exit every file and directory in it is fsynced and :func:`replace_dir` puts it in place; if the block
    raises, the temporary directory is deleted, ``target`` is left as it was and the exception propagates. The
    leftovers of killed writers of ``target`` are deleted first (one writer per target). The parent must exist.
    """
    target = Path(target)
    recover_dir(target)
    remove_stale_temporaries(target.parent, target.name)
    while True:
        tmp = temporary_path(target)
        try:
            os.mkdir(tmp, 0o777)  # the mode a plain mkdir gives (less the umask), not mkdtemp's 0o700
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        if kind is not None:
            write_output_marker(tmp, kind, [n for n in os.listdir(tmp) if not _is_ours(n)])
        fsync_tree(tmp)
        replace_dir(tmp, target)
    except BaseException:
        # before the swap tmp is the unfinished new version, after it the old one: either way not wanted
        _remove(tmp, ignore_errors=True)
        raise


def make_dirs(path: str | os.PathLike) -> list[Path]:
    """``mkdir -p path``; returns the directories it created, outermost first (empty when ``path`` existed), so
    that a command that fails can take them back (:func:`remove_empty_dirs`)."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def remove_empty_dirs(dirs: list[Path]) -> None:
    """Delete the directories ``make_dirs`` created, innermost first, as long as they are empty."""
    for d in reversed(dirs):
        try:
            os.rmdir(d)
        except OSError:
            return


def check_writable(target: str | os.PathLike) -> list[Path]:
    """Make sure ``target`` can be written before any long work: create its parent directory (returns what
    :func:`make_dirs` created) and create and delete a probe file beside it (named as a temporary of ``target``,
    so a leftover is cleaned like one). An OSError names ``target``."""
    target = Path(target)
    created = make_dirs(target.parent)
    probe = temporary_path(target)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        remove_empty_dirs(created)
        raise OSError(e.errno, e.strerror, os.fspath(target)) from e
    return created


def _remove(path: Path, ignore_errors: bool = False) -> None:
    """Delete a file, a link or a whole directory tree."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=ignore_errors)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        if not ignore_errors:
            raise


# --------------------------------------------------------------------------------------------------------------
# errors


_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


def os_error_message(exc: OSError, path: str | os.PathLike, what: str = "write", option: str = "--out") -> str:
    """One line for a command to print instead of a traceback, e.g.

        cannot write runs/x/model.safetensors: Read-only file system (errno 30); choose a writable --out
        disk full while writing runs/x/hf (1,204 bytes free); nothing was replaced; free space or choose another --out

    ``what`` is the verb ("write", "create", "replace"), ``option`` the command-line option that picks the place.
    A full disk (or quota) has its own wording (:func:`disk_full_message`): every write here is atomic, so what
    was there before is intact.
    """
    if exc.errno in _DISK_FULL:
        return disk_full_message(path, option)
    reason = exc.strerror or str(exc)
    line = f"cannot {what} {os.fspath(path)}: {reason}"
    if exc.errno is not None:
        line += f" (errno {exc.errno})"
    if exc.errno in _NO_SPACE:
        line += f"; free space or choose another {option}"
    elif exc.errno in _NOT_WRITABLE and what == "read":
        line += f"; check its permissions or choose another {option}"
    elif exc.errno in _NOT_WRITABLE:  # read-only file system, permission denied
        line += f"; choose a writable {option}"
    return line


# --------------------------------------------------------------------------------------------------------------
# output directories: whose they are, and who is writing them


OUTPUT_MARKER = ".z2all-output.json"
"""The file every command writes into the directory it produces: ``{"kind": ..., "entries": [...]}``. It is how a
later command recognises a previous output of the same kind (and so may write over it) and tells it apart from a
folder of the user's own, which is never written into."""

LOCK_FILE = ".z2all-lock"
"""The advisory lock file of a directory being written by a run (:class:`OutputLock`)."""


class OutputDirError(ValueError):
    """An output directory holds something that is not a previous output of the same kind (the user's files, the
    command's own input, the working directory): nothing is written, the command stops with one line."""


class OutputLockedError(ValueError):
    """Another live process holds the lock of an output directory."""


def read_output_marker(path: str | os.PathLike) -> dict | None:
    """The marker of output directory ``path`` (:data:`OUTPUT_MARKER`), or None when it has none (or an unreadable
    one)."""
    try:
        data = json.loads((Path(path) / OUTPUT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("kind"), str) else None


def write_output_marker(path: str | os.PathLike, kind: str, entries: list[str] | None = None) -> Path:
    """Mark directory ``path`` as an output of ``kind``. ``entries``: the top-level names the output consists of
    (a directory replaced whole: a later writer refuses to replace it when anything else has been added); None for
    a directory that grows (a training run, token shards) and is never replaced whole."""
    data: dict[str, Any] = {"kind": kind}
    if entries is not None:
        data["entries"] = sorted(entries)
    return save_json(data, Path(path) / OUTPUT_MARKER)


def _is_ours(name: str) -> bool:
    """Names a writer of this module leaves in an output directory: the marker, the lock, temporaries."""
    return name in (OUTPUT_MARKER, LOCK_FILE) or temporary_target(name) is not None


def _inside(child: Path, parent: Path) -> bool:
    """``child`` is ``parent`` or lies under it (both resolved)."""
    return child == parent or parent in child.parents


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def claim_output_dir(path: str | os.PathLike, kind: str, inputs: Any = (), overwrite: bool = True,
                     option: str = "--out", legacy: Any = None) -> str:
    """Check, before any work, that a command of ``kind`` may write directory ``path``; returns what it holds:
    ``"absent"``, ``"empty"`` or ``"previous"`` (an earlier output of the same kind). Anything else raises
    :class:`OutputDirError` with one line naming what is in the way, and nothing is written:

    * ``path`` is the working directory or one of its parents, or holds one of ``inputs`` (paths the command
      reads, ``NAME=PATH`` understood: ``export-hf --ckpt keep/ckpt --out keep``), whatever ``overwrite`` says;
    * ``path`` is a file, or a folder with anything but a previous output of ``kind`` in it (recognised by its
      :data:`OUTPUT_MARKER`; for a whole-directory output, also nothing added since it was written);
    * a previous output of ``kind`` when ``overwrite`` is False (the message says to pass ``--overwrite``).

    ``legacy(path) -> bool`` recognises an output of ``kind`` written before outputs carried a marker. ``option``
    is the command-line option named in messages.
    """
    target = Path(path)
    where = f"{option} {os.fspath(path)}"
    what_kind = f"`z2all {kind}`"
    resolved = target.resolve()
    cwd = Path.cwd().resolve()
    if _inside(cwd, resolved):
        what = "the working directory" if resolved == cwd else "a parent of the working directory"
        raise OutputDirError(f"{where} is {what}: choose a new folder for the output (e.g. {option} "
                             f"{os.fspath(target / kind)})")
    for item in [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs or ()):
        if item is not None and not os.path.lexists(item) and "=" in os.fspath(item):
            item = os.fspath(item).split("=", 1)[1]  # a named source, NAME=PATH
        if item is None or not os.path.lexists(item):
            continue
        if _inside(Path(item).resolve(), resolved):
            raise OutputDirError(f"{where} holds the input {os.fspath(item)}: writing there would replace it; "
                                 f"choose another {option}")
    if not os.path.lexists(target):
        return "absent"
    if not target.is_dir():
        raise OutputDirError(f"{where} is a file, not a folder: choose another {option}")
    names = sorted(os.listdir(target))
    foreign = [n for n in names if not _is_ours(n)]
    if not foreign:
        marker = read_output_marker(target)
        if marker is None or marker["kind"] == kind:
            return "empty" if marker is None else _previous(where, kind, overwrite)
    marker = read_output_marker(target)
    if marker is None and legacy is not None and legacy(target):
        return _previous(where, kind, overwrite)
    shown = _listing([n + "/" if (target / n).is_dir() else n for n in foreign])
    if marker is None:
        raise OutputDirError(f"{where} already holds files that are not an output of {what_kind} ({shown}): "
                             f"choose a new or empty folder, or move them away")
    if marker["kind"] != kind:
        raise OutputDirError(f"{where} holds an output of `z2all {marker['kind']}`, not of {what_kind}: choose another "
                             f"{option}")
    entries = marker.get("entries")
    if isinstance(entries, list):
        added = [n for n in foreign if n not in entries]
        if added:
            raise OutputDirError(f"{where} holds a previous output of {what_kind} with files added to it "
                                 f"({_listing(added)}): move them away or choose another {option}")
    return _previous(where, kind, overwrite)


def claim_output_file(path: str | os.PathLike, overwrite: bool = False, inputs: Any = (),
                      option: str = "--out") -> str:
    """Check, before any work, that a command may write the single file ``path``; returns ``"absent"`` or
    ``"existing"`` (a file that ``overwrite`` allows to replace). Raises :class:`OutputDirError` with one line,
    writing nothing, when ``path`` is a folder, is or lies inside one of ``inputs`` (whatever ``overwrite`` says),
    or is an existing file and ``overwrite`` is False. The writer itself writes beside ``path`` and renames onto
    it (:func:`atomic_write`), so a failed or killed run leaves the previous file or none."""
    target = Path(path)
    where = f"{option} {os.fspath(path)}"
    if target.is_dir():
        raise OutputDirError(f"{where} is a folder: name a file (a new one, or one to replace with --overwrite)")
    resolved = target.resolve()
    for item in [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs or ()):
        if item is None or not os.path.lexists(item):
            continue
        if _inside(resolved, Path(item).resolve()) and os.path.lexists(target):
            raise OutputDirError(f"{where} is the input {os.fspath(item)} or lies inside it: writing there would "
                                 f"replace it; choose another {option}")
    if not os.path.lexists(target):
        return "absent"
    if not overwrite:
        raise OutputDirError(f"{where} already exists: pass --overwrite to replace it, or choose another name")
    return "existing"


def _previous(where: str, kind: str, overwrite: bool) -> str:
    if not overwrite:
        raise OutputDirError(f"{where} holds a previous output of `z2all {kind}`: pass --overwrite to replace it, or "
                             f"choose another folder")
    return "previous"


class OutputLock:
    """An advisory lock on an output directory for the time a process writes it: ``DIR/.z2all-lock``, held with
    ``flock`` and naming the host and process id of its holder.

    A second process that asks for the lock while the first holds it gets :class:`OutputLockedError` at once. The
    operating system releases an ``flock`` when its holder dies, however it dies, so a lock file left by a killed
    run is stale by construction: the next run takes it over and says whose it was (``on_takeover``). Where
    ``flock`` is unavailable the lock falls back to the file's content: a live process id on this host holds it.

    The lock keeps processes apart, not objects of one process: a second ``OutputLock`` of the same directory in
    the process that holds it shares the hold (counted; the file is let go with the last release), so a program
    that builds a second trainer on its own folder (a resumed run in a test, a benchmark) is not refused.
    """

    _held: dict[str, list] = {}  # lock file (resolved) -> [descriptor, holders] of this process

    def __init__(self, directory: str | os.PathLike, on_takeover=None):
        self.path = Path(directory) / LOCK_FILE
        self.on_takeover = on_takeover
        self.fd: int | None = None
        self._key = os.path.realpath(self.path)

    @staticmethod
    def _holder(text: str) -> tuple[str, int] | None:
        try:
            data = json.loads(text)
            return str(data["host"]), int(data["pid"])
        except (ValueError, KeyError, TypeError):
            return None

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's live process
            return True
        return True

    def acquire(self) -> OutputLock:
        import socket

        if self.fd is not None:
            return self
        shared = OutputLock._held.get(self._key)
        if shared is not None:
            shared[1] += 1
            self.fd = shared[0]
            return self
        host = socket.gethostname()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            previous = os.read(fd, 4096).decode("utf-8", "replace")
            holder = self._holder(previous)
            try:
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked_by_os = True
            except ImportError:
                locked_by_os = False
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                who = f"process {holder[1]} on {holder[0]}" if holder else "another process"
                raise OutputLockedError(f"{self.path.parent} is in use by {who} (lock file {self.path}): wait "
                                        f"for it to finish or choose another --out") from None
            if holder is not None and holder != (host, os.getpid()):
                if not locked_by_os and holder[0] == host and self._alive(holder[1]):
                    raise OutputLockedError(f"{self.path.parent} is in use by process {holder[1]} on {holder[0]} "
                                            f"(lock file {self.path}): wait for it to finish or choose another "
                                            f"--out")
                if self.on_takeover is not None:
                    self.on_takeover(f"{self.path}: taking over the lock left by process {holder[1]} on "
                                     f"{holder[0]}, which no longer holds it")
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps({"host": host, "pid": os.getpid()}).encode() + b"\n")
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        OutputLock._held[self._key] = [fd, 1]
        return self

    def release(self) -> None:
        """Empty the lock file and let go of it (the file stays: deleting it would race a process opening it)."""
        if self.fd is None:
            return
        shared = OutputLock._held.get(self._key)
        if shared is not None and shared[0] == self.fd:
            shared[1] -= 1
            if shared[1] > 0:
                self.fd = None
                return
            del OutputLock._held[self._key]
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing the descriptor drops the flock
        self.fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def locked_output_dir(directory: str | os.PathLike, on_takeover=None) -> Iterator[list[Path]]:
    """Create ``directory`` (``mkdir -p``) and hold its :class:`OutputLock` for the ``with`` block: a second
    process on the same folder gets :class:`OutputLockedError` at once. Yields the directories this call created;
    when the block ends the lock file goes again if this call made it (a folder is left as the command's output
    made it, a failed run's as it was), and created folders left empty are removed. (A lock file that was there
    before stays: a process may be opening it.)"""
    created = make_dirs(directory)
    made_lock = not (Path(directory) / LOCK_FILE).exists()
    try:
        lock = OutputLock(directory, on_takeover=on_takeover).acquire()
    except BaseException:
        remove_empty_dirs(created)
        raise
    try:
        yield created
    finally:
        lock.release()
        if made_lock:
            with contextlib.suppress(OSError):
                os.unlink(Path(directory) / LOCK_FILE)
        if created:
            remove_empty_dirs(created)


# --------------------------------------------------------------------------------------------------------------
# full disks


_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# how libraries that do not raise OSError(ENOSPC) say it: safetensors (a Rust io::Error), numpy's tofile (a short
# write without errno), the OS's own text inside a wrapped error
_DISK_FULL_TEXT = ("no space left on device", "os error 28", "storagefull", "disk quota exceeded")
_SHORT_WRITE = re.compile(r"\b\d+ requested and \d+ written\b")
_NEARLY_FULL_BYTES = 64 << 20  # below this much free space an unexplained failed write is taken for a full disk


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent); None if unknown."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def disk_full_message(path: str | os.PathLike, option: str = "--out") -> str:
    """``disk full while writing PATH (N bytes free); nothing was replaced; free space or choose another --out``."""
    free = free_bytes(path)
    left = f"{free:,} bytes free" if free is not None else "free space unknown"
    return f"disk full while writing {os.fspath(path)} ({left}); nothing was replaced; free space or choose another " \
           f"{option}"


def as_disk_full(exc: BaseException, path: str | os.PathLike | None = None) -> OSError | None:
    """``OSError(ENOSPC)`` when ``exc`` means the disk (or quota) is full, whichever library raised it: an OSError
    with that errno, safetensors' "No space left on device (os error 28)", numpy's short write "N requested and M
    written", torch's "file write failed" while fewer than 64 MB are free at ``path``; else None. The filename is
    the error's own, else ``path``."""
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return exc
    text = str(exc).lower()
    full = any(t in text for t in _DISK_FULL_TEXT) or (isinstance(exc, OSError) and _SHORT_WRITE.search(text))
    if not full and "file write failed" in text and path is not None:
        free = free_bytes(path)
        full = free is not None and free < _NEARLY_FULL_BYTES
    if not full:
        return None
    filename = getattr(exc, "filename", None) if isinstance(exc, OSError) else None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename if filename is not None else
                   (os.fspath(path) if path is not None else None))
