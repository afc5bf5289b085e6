"""The output folder of a tool (``prepare``, ``export``/``consolidate``, ``report``): checked before
anything is written, written in a temporary sibling folder, and moved into place when complete.

- It never overlaps an input: replacing it at the end would take the input with it (``check_apart``).
- A file is never an output folder, and a non-empty folder is replaced only when it holds what the
  same tool wrote earlier (``check_replaceable``): never a user's own files.
- A write the file system refuses (full, over a quota, read-only, no permission, a file where a folder
  should be) is one ``WriteFailedError`` naming the output, and leaves neither the temporary folder nor
  the parent folders made for it (``staged``); an earlier output stays as it was until the rename.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from lightning_train.errors import UserInputError, os_error_of, write_failed


def check_apart(output: Path, option: str, inputs: Iterable[tuple[str, str | Path]], fix: str,
                inside_allowed: bool = False) -> None:
    """Refuse an ``output`` that is, contains or (unless ``inside_allowed``) lies inside one of
    ``inputs``: (what the message calls it, path) pairs. Messages name ``output`` as given."""
    out = output.expanduser().resolve()
    for noun, path in inputs:
        found = Path(path).expanduser().resolve()
        if out == found:
            where = "is"
        elif found.is_relative_to(out):
            where = "contains"
        elif out.is_relative_to(found) and not inside_allowed:
            where = "lies inside"
        else:
            continue
        raise UserInputError(f"{option} {output} {where} {noun}; {fix}")


def check_replaceable(output: Path, option: str, overwrite: bool | None, earlier: str,
                      is_earlier: Callable[[Path], bool]) -> bool:
    """Refuse a file as ``output``, and a non-empty folder unless ``is_earlier`` finds the tool's own
    output there (``earlier`` names it: "a dataset prepare wrote") and ``overwrite`` allows replacing it
    (None: the tool always replaces its earlier output). Returns whether ``output`` holds an earlier
    output to replace."""
    out = output.expanduser()
    if out.exists() and not out.is_dir():
        raise UserInputError(f"{option} {output} is a file; pass a folder to write (a new or an empty one)")
    if not out.is_dir() or not any(out.iterdir()):
        return False
    check_filled(output, option, is_earlier(out), overwrite, earlier)
    return True


def check_filled(output: Path | str, option: str, holds_earlier: bool, overwrite: bool | None,
                 earlier: str) -> None:
    """Refuse a non-empty ``output`` that holds no earlier output of the tool, and one that does unless
    ``overwrite`` (None: the tool always replaces it): ``check_replaceable``'s refusals."""
    if not holds_earlier:
        only = "" if overwrite is None else " (--overwrite true replaces only that)"
        raise UserInputError(
            f"{option} {output} already exists and is not empty, and is not {earlier}{only}; "
            f"choose another {option}, or empty that folder first"
        )
    if overwrite is False:
        raise UserInputError(
            f"{option} {output} already exists and is not empty (it is {earlier}); pass --overwrite true "
            f"to replace it, or choose another {option}"
        )


@contextmanager
def staged(output: Path, fix: str, needed: int | None = None) -> Iterator[Path]:
    """A new empty folder beside ``output`` (the same file system, so moving it into place is a rename)
    to write the output in; removed on the way out, with the parent folders made for it when the block
    fails. An ``OSError`` making it, writing in it or moving it into ``output`` becomes one
    ``WriteFailedError`` naming ``output`` with ``fix`` (``needed``: the bytes the output needs, where
    known); any other error, one reading an input among them, passes unchanged."""
    output = output.expanduser().resolve()
    made = [folder for folder in output.parents if not folder.exists()]  # the deepest first
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    except OSError as error:
        _remove_empty(made)
        raise write_failed(output, error, fix, needed) from error
    try:
        tmp.chmod(0o777 & ~umask())  # mkdtemp makes it private; the output is as readable as any folder
        yield tmp
    except Exception as error:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        os_error = None if isinstance(error, UserInputError) else os_error_of(error)
        if os_error is None or not _about_output(os_error, output, tmp):
            raise
        raise write_failed(output, error, fix, needed) from error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # still there only after a failure: publish moved it


def publish(tmp: Path, output: Path, replace: bool) -> None:
    """Move the finished folder ``tmp`` into place as ``output`` with one rename, so readers never see
    half an output; ``replace``: the earlier output there (checked to be the tool's own) goes."""
    output = output.expanduser().resolve()
    if replace and output.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
        output.rename(old / output.name)
        try:
            tmp.rename(output)
        except OSError:
            (old / output.name).rename(output)  # the earlier output back as it was
            old.rmdir()
            raise
        shutil.rmtree(old)
        return
    try:
        tmp.rename(output)  # onto nothing or an empty folder
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise UserInputError(
            f"{output} was filled by another process meanwhile; run again to see what it holds"
        ) from err


def umask() -> int:
    """The process's umask, for files and folders whose writer gives them private permissions."""
    mask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        with suppress(OSError):  # in order, the deepest first; one that is not empty stays
            folder.rmdir()


def _about_output(error: OSError, output: Path, tmp: Path) -> bool:
    """Whether ``error`` is about the output side: a path in ``tmp`` or ``output``, a hidden sibling of
    ``output`` made to replace it, or no path at all (a write to a file already open)."""
    names = [name for name in (error.filename, error.filename2) if isinstance(name, str | os.PathLike)]
    for name in names:
        path = Path(name).resolve()
        sibling = path.parent == output.parent and path.name.startswith(f".{output.name}.")
        if sibling or path.is_relative_to(output) or path.is_relative_to(tmp):
            return True
    return not names
