"""fsutil.py: atomic writes of files and folders, shared by every stage that writes to disk.

    with fsutil.atomic_dir(Path("runs/x/checkpoints/step_000020")) as tmp:
        (tmp / "state.pt").write_bytes(...)          # fill tmp; on success it becomes the
                                                     # target, atomically
    fsutil.atomic_write_text(Path("runs/x/config.json"), text)

Why a module of its own: an atomic write renames a temporary into place, and a rename works only
inside one filesystem. The temporary must therefore sit next to its target, never in $TMPDIR (a
tmpfs /tmp, as on Fedora and Arch, is another filesystem: rename fails with EXDEV). Every writer
goes through these few functions so that rule holds everywhere. Temporaries are hidden names that
start with "." and hold ".tmp-"; `clean_stale` removes the ones a killed process left behind.
Folders get the usual permissions (0777 less the umask), not mkdtemp's 0700.

Leaves out: fsync of the data (a power cut may lose the last write, never leave a half-written
target).
"""
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

TMP_TAG = ".tmp-"  # every temporary made here has a name ".<target name>.tmp-<random>"


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read the umask is to set it and put it back
    os.umask(mask)
    return mask


@contextmanager
def atomic_dir(target: Path, replace: bool = False):
    """Yield an empty temporary folder beside `target`; on a clean exit it becomes `target` in one
    rename.

    replace=False: an existing target is an error (FileExistsError), raised before anything is
    written.
    replace=True: the old target is swapped out and removed only after the new one is in place.
    On any exception (Ctrl-C included) the temporary is removed and the target is untouched."""
    target = Path(target)
    if target.exists() and not replace:
        raise FileExistsError(f"{target} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{TMP_TAG}", dir=target.parent))
    try:
        # mkdtemp makes 0700; a run folder should read like any other
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        if replace and target.exists():
            # swap, then drop the old folder
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}{TMP_TAG}old-", dir=target.parent))
            os.rmdir(old)  # only its unique name is wanted
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            # a target made meanwhile by someone else makes this rename fail: theirs is never
            # deleted
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: Path, blob: bytes) -> Path:
    """Write `blob` to `path` through a temporary file beside it and os.replace (atomic on
    POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TMP_TAG}", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def clean_stale(folder: Path) -> list[Path]:
    """Remove the temporaries a killed writer left in `folder` (only names made by this module).
    Returns them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.iterdir() if p.name.startswith(".") and TMP_TAG in p.name]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return stale


def check_writable(out, flag: str = "--out", inside: bool = True) -> None:
    """A ValueError for an output path that cannot be written, before any work: the nearest folder
    that exists on the way to where the files go (inside `out`, or beside it for a folder written
    by atomic_dir) must take a new file. Tried with a hidden temporary, removed at once:
    permission bits alone say nothing for root or on a read-only filesystem."""
    out = Path(out)
    near = out.absolute() if inside else out.absolute().parent
    while not near.exists() and near != near.parent:
        near = near.parent
    if not near.is_dir():
        raise ValueError(f"{flag} {out}: {near} is a file, not a folder; choose another {flag}")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{out.name}{TMP_TAG}", dir=near)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {out} cannot be written ({e.strerror} in {near}): choose a "
                         f"writable {flag}") from None
