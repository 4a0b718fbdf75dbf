"""Private folders and files: what the agent and the CLI may trust on a shared host.

A folder under /tmp with a predictable name (``/tmp/aiprof-<uid>``, ``/tmp/aiprof-cache-<uid>``)
can be created first by another local user. Anything we later read from it (a cached helper
``.so``, a socket we connect to, a script we inject) is then theirs. So such a folder is used
only once :func:`ensure_private_dir` has created it, or checked it with ``lstat``: a real
folder (not a symlink), owned by us, writable by nobody else. A file we are about to load
gets the same check (:func:`check_private_file`). Standard library only (runs in the job).
"""
from __future__ import annotations

import errno
import os
import stat

# group or other may write: another user could add, rename or (without the sticky bit) remove entries
FOREIGN_WRITE_BITS = stat.S_IWGRP | stat.S_IWOTH


class UnsafePath(OSError):
    """A folder or file that is not ours alone; ``str()`` is the one-line reason."""


def _problem(st: os.stat_result, want_dir: bool, uid: int) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if want_dir and not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if not want_dir and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not {uid}"
    if st.st_mode & FOREIGN_WRITE_BITS:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_private_dir(path: str, uid: int | None = None, tighten: bool = False) -> None:
    """Raise :class:`UnsafePath` unless ``path`` is a real folder owned by ``uid`` (default: us)
    that no other user can write to.

    ``tighten``: a folder of ours that a loose umask made group/other-writable loses those bits
    instead (its files are still checked one by one before use). Checked through a descriptor
    opened with O_NOFOLLOW, so the folder checked is the folder changed.
    """
    uid = os.geteuid() if uid is None else uid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafePath(f"{path} is a symlink") from None
        if exc.errno == errno.ENOTDIR:
            raise UnsafePath(f"{path} is not a folder") from None
        raise
    try:
        st = os.fstat(fd)
        why = _problem(st, True, uid)
        if why and tighten and st.st_uid == uid and stat.S_ISDIR(st.st_mode):
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~FOREIGN_WRITE_BITS)
            return
    finally:
        os.close(fd)
    if why:
        raise UnsafePath(f"{path} {why}")


def check_private_file(path: str) -> None:
    """Raise :class:`UnsafePath` unless ``path`` is a regular file of ours that no other user can
    write (checked before a shared object is loaded)."""
    why = _problem(os.lstat(path), False, os.geteuid())
    if why:
        raise UnsafePath(f"{path} {why}")


def ensure_private_dir(path: str, mode: int = 0o700) -> str:
    """Create ``path`` (its parents as needed) with ``mode``, or check the folder already there;
    returns ``path``. Raises :class:`UnsafePath` (someone else's folder, a symlink) or
    :class:`OSError`.

    The last component is made with ``mkdir``, never ``makedirs(exist_ok=True)`` alone, so a
    folder that was there before is always checked rather than trusted; one of ours left
    group/other-writable by a loose umask is tightened.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    check_private_dir(path, tighten=True)
    return path
