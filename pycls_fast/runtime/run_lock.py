"""One training per OUT_DIR at a time: an advisory lock on OUT_DIR/.lock.

The lock is an fcntl lock, so it is released by the kernel when its process ends,
however it ends (a SIGKILL included): a crashed run never leaves a stale lock behind.
It works on local filesystems and on NFS with lockd; some network filesystems ignore
it.
"""

import fcntl
import os
import time

from pycls_fast.errors import OutDirInUseError

LOCK_FILE = ".lock"


class RunLock:
    """Holds OUT_DIR/.lock for the life of a training: `with RunLock(out_dir):`, or
    `acquire()` ... `release()`."""

    def __init__(self, out_dir: str) -> None:
        self.path = os.path.join(out_dir, LOCK_FILE)
        self.fd = None

    def acquire(self) -> "RunLock":
        """Takes the lock; OutDirInUseError naming the holder if another has it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutDirInUseError(
                f"OUT_DIR {os.path.dirname(self.path)} is in use by another training "
                f"({holder}): wait for it to end, or choose another OUT_DIR"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}, since {time.strftime('%F %T')}".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> bool:
        self.release()
        return False
