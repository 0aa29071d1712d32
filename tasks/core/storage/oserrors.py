"""An OS error during a stage, said in one line: the path, its filesystem, free and needed space, the fix.

    python -c "import errno; from tasks.core.storage.oserrors import describe; print(describe(errno.ENOSPC, '/tmp/x'))"

A bare `OSError: [Errno 28] No space left on device` names neither the file nor the disk, and a
write error from `f.write` carries no filename at all; the flow passes the stage's artifact
directory as the place, and the run's disk estimate (pre-flight's) as what it needs. Errors the
ranks raise come back as text (`rank N: OSError: [Errno 28] ...`): `errno_of` reads the number there too.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

# Errors of the disk or its permissions: none heals by retrying in a few seconds.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")


def human_bytes(n: float) -> str:
    """Decimal units, as df and the disk estimate print them."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


def os_error_of(exc: BaseException | None) -> OSError | None:
    """The first OSError with an errno in `exc`'s chain (causes and contexts), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def errno_of(exc: BaseException) -> tuple[int, str | None] | None:
    """(errno, filename or None) of an OS error in `exc`'s chain, or read from its text (a rank's cause line)."""
    err = os_error_of(exc)
    if err is not None:
        # shutil's copies set filename to the source and filename2 to the destination, the one written
        names = [n for n in (err.filename2, err.filename) if isinstance(n, str)]
        return err.errno, names[0] if names else None
    m = _ERRNO_TEXT.search(str(getattr(exc, "cause", None) or exc))
    return (int(m.group(1)), None) if m else None


def filesystem(path: str | Path) -> tuple[Path, str, str]:
    """(the nearest existing directory, the mount point and filesystem type it is on)."""
    p = Path(os.path.realpath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    mount, fstype = Path("/"), "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    point = Path(parts[1].replace("\\040", " "))
                    if (p == point or point in p.parents) and len(str(point)) >= len(str(mount)):
                        mount, fstype = point, parts[2]
    except OSError:  # no /proc (not Linux): the mount stays unknown
        pass
    return p, str(mount), fstype


def note_free(exc: BaseException, path: str | Path) -> None:
    """Record on a disk error the space free at `path` when it happened (`free_at_failure`), before
    the stage removes its partial output and the disk looks roomy again."""
    err = os_error_of(exc)
    if err is not None and err.errno in DISK_ERRNOS:
        try:
            err.free_at_failure = shutil.disk_usage(filesystem(path)[0]).free
        except OSError:
            pass


def describe(
    err_no: int, path: str | Path, need: int | None = None, field: str = "run_root", free_then: int | None = None
) -> str:
    """One line for an OS error at `path`: what happened, the filesystem, free and needed space, the fix."""
    where, mount, fstype = filesystem(path)
    try:
        du = shutil.disk_usage(where)
        now = f"{human_bytes(du.free)} free of {human_bytes(du.total)}"
        space = (
            now
            if free_then is None
            else f"{human_bytes(free_then)} free when it failed, {now} now that the stage's partial output is removed"
        )
    except OSError:
        space = "free space unknown"
    needs = f"; the run needs about {human_bytes(need)} there in all (pre-flight's estimate)" if need else ""
    fs = f"on {mount} ({fstype}, {space}{needs})"
    name = errno.errorcode.get(err_no, str(err_no))
    what = f"{os.strerror(err_no)} ({name}) writing {path} {fs}"
    if err_no in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        fix = (
            "free space there (older <dir>.superseded-* folders, other runs), lower keep_last, or point "
            f"{field} at a larger disk, then run again: finished stages are skipped"
        )
    elif err_no == errno.EROFS:
        fix = f"remount it read-write or point {field} at a writable directory"
    elif err_no in (errno.EACCES, errno.EPERM):
        fix = f"make {where} writable for user {os.getuid()} or point {field} elsewhere"
    else:
        fix = "check the disk (dmesg), then run again: finished stages are skipped"
    return f"{what}: {fix}"


def stage_cause(exc: BaseException, place: str | Path, need: int | None = None, field: str = "run_root") -> str | None:
    """The one-line cause of a stage failure that is a disk or permission error (`DISK_ERRNOS`, EIO),
    at the failing file when the error names it, else at `place` (the stage's directory); None otherwise."""
    found = errno_of(exc)
    if found is None or found[0] not in DISK_ERRNOS | {errno.EIO}:
        return None
    free_then = getattr(os_error_of(exc), "free_at_failure", None)
    return f"{type(exc).__name__}: {describe(found[0], found[1] or place, need, field, free_then)}"


def overwrite_in_place(path: Path, text: str) -> bool:
    """On a full disk, where tmp + rename cannot allocate a new file: rewrite `path` over the
    blocks it already holds, only when `text` fits in them (so it never ends half-written)."""
    data = text.encode()
    try:
        st = path.stat()
        if len(data) > st.st_blocks * 512:
            return False
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate(len(data))
        return True
    except OSError:
        return False
