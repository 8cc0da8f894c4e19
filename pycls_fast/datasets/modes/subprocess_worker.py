"""The child process of 'subprocess' mode: the decoding threads, outside the trainer.

    python -m pycls_fast.datasets.modes.subprocess_worker FD THREADS PREFETCH STATS

Started by subprocess_loader.py with one end of a socket pair as FD. The child runs
the same per-image tasks as 'threads' mode (ImageDecoder, `iterate_threaded`), and
writes each batch into a slot: a buffer the parent made (an anonymous `memfd`, so
nothing is left in /dev/shm whatever happens to either process) and sent as a file
descriptor. Only small messages cross the socket: which slot holds which batch, its
labels and its bad images.

The messages (pickled, length-prefixed; slot descriptors ride along as SCM_RIGHTS):
  parent -> child: ("decoder", ImageDecoder), ("slots", [(id, shape)]) + fds,
    ("drop_slots",), ("epoch", token, epoch, [(seq, indices)]), ("free", [id]),
    ("stop", token)
  child -> parent: ("ready", pid), ("batch", token, seq, slot, n, labels, bad),
    ("error", token, type name, message, traceback), ("log", name, level, text)

The child ends when the parent does: its main thread reads the socket, and a closed
socket (the parent exited or was killed) ends the process at once; a watchdog also
ends it if it is re-parented. SIGINT and SIGTERM are ignored: a stop signal is the
training process's to handle (it writes a checkpoint and then closes the socket).
"""

import array
import collections
import logging
import mmap
import os
import pickle
import queue
import signal
import socket
import struct
import sys
import threading
import time
import traceback

import numpy as np

_HEADER = struct.Struct("<Q")
_MAX_FDS = 64  # file descriptors a single message may carry


def send_message(sock: socket.socket, lock: threading.Lock, message, fds=()) -> None:
    """Sends `message` (picklable) and the file descriptors `fds` over `sock`."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    with lock:
        if fds:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            sent = sock.sendmsg([header], rights)
            sock.sendall(header[sent:])
        else:
            sock.sendall(header)
        sock.sendall(data)


def _recv_exact(sock, n, first=b""):
    parts, got = [first], len(first)
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 22))
        if not chunk:
            raise EOFError("the other end closed the socket")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def recv_message(sock: socket.socket) -> tuple[object, list[int]]:
    """Receives one message from `sock`: (message, file descriptors). EOFError when
    the other end has closed."""
    fds = array.array("i")
    data, ancillary, _flags, _addr = sock.recvmsg(
        _HEADER.size, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize)
    )
    if not data:
        raise EOFError("the other end closed the socket")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, data))
    return pickle.loads(_recv_exact(sock, size)), list(fds)


def map_slot(fd: int, shape: tuple[int, ...]) -> np.ndarray:
    """The uint8 array of `shape` over the shared memory behind `fd` (closed here:
    the mapping keeps the memory)."""
    size = int(np.prod(shape))
    try:
        buf = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return np.frombuffer(buf, dtype=np.uint8, count=size).reshape(shape)


class EpochStopped(Exception):
    """The parent abandoned the epoch being decoded."""


class Slots:
    """The child's batch buffers (the ImageDecoder's `pool`): a decoding thread
    takes a free slot for a batch; the parent frees it once the batch is used.

    A slot is the child's from `get` until `handed_over` (its batch was sent: the
    parent's until it frees it); the runner thread gives back, with `reclaim`, every
    slot still taken when an epoch ends, whichever way it ends (finished, abandoned
    by the parent, an error), once the epoch's decoding threads are done."""

    def __init__(self) -> None:
        self.arrays: dict[int, np.ndarray] = {}
        self._by_address: dict[int, int] = {}
        self._free = collections.deque()
        self._taken: set[int] = set()  # by decoding threads, batch not sent
        self._cv = threading.Condition()
        # The stop event of the epoch being decoded (set by the runner thread).
        self.stop_event = threading.Event()

    def add(self, slot: int, array: np.ndarray) -> None:
        with self._cv:
            self.arrays[slot] = array
            self._by_address[array.ctypes.data] = slot
            self._free.append(slot)
            self._cv.notify()

    def drop_all(self) -> None:
        with self._cv:
            self.arrays.clear()
            self._by_address.clear()
            self._free.clear()

    def slot_at(self, address: int) -> int:
        """The slot whose memory starts at `address`."""
        with self._cv:
            return self._by_address[address]

    def free(self, slots) -> None:
        with self._cv:
            for slot in slots:
                if slot in self.arrays:  # not one of a dropped shape
                    self._free.append(slot)
            self._cv.notify_all()

    def handed_over(self, slot: int) -> None:
        """The batch in `slot` was sent: the slot is the parent's to free."""
        with self._cv:
            self._taken.discard(slot)

    def reclaim(self) -> None:
        """Frees the slots taken and not handed over (called between epochs, when no
        decoding thread is left to write into them)."""
        with self._cv:
            self._free.extend(s for s in self._taken if s in self.arrays)
            self._taken.clear()
            self._cv.notify_all()

    def wake(self) -> None:
        """Wakes the threads waiting in `get`, to see their epoch's stop event."""
        with self._cv:
            self._cv.notify_all()

    def get(self, shape: tuple[int, ...]) -> np.ndarray:
        """The first `shape[0]` rows of a free slot (BufferPool's interface)."""
        with self._cv:
            while not self._free and not self.stop_event.is_set():
                self._cv.wait()
            if self.stop_event.is_set():
                raise EpochStopped()
            slot = self._free.popleft()
            self._taken.add(slot)
            array = self.arrays[slot]
        if array.shape[1:] != tuple(shape[1:]) or array.shape[0] < shape[0]:
            raise RuntimeError(f"slot of shape {array.shape} for a batch of {shape}")
        return array[: shape[0]]


class _ForwardLogs(logging.Handler):
    """Sends the child's log records to the parent, which logs them as its own."""

    def __init__(self, sock, lock):
        super().__init__()
        # Not `self.lock`: that is the Handler's own, held while `emit` runs.
        self.sock, self.send_lock = sock, lock

    def emit(self, record):
        try:
            message = ("log", record.name, record.levelno, record.getMessage())
            send_message(self.sock, self.send_lock, message)
        except OSError:
            pass


def _run_epochs(sock, lock, slots, jobs, threads, prefetch, stats_period):
    """The runner thread: decodes each queued epoch's batches into slots."""
    from pycls_fast.datasets.modes.threaded import iterate_threaded

    while True:
        token, epoch, decoder, items, stop = jobs.get()
        # No thread of the epoch before is left: closing its engine waited for them.
        slots.stop_event = stop
        engine = None
        try:
            engine = iterate_threaded(
                decoder,
                (indices for _, indices in items),
                epoch,
                threads,
                prefetch,
                stats_period,
            )
            for (seq, _), batch in zip(items, engine, strict=True):
                if stop.is_set():
                    break  # its slot is reclaimed below
                slot = slots.slot_at(batch.images.untyped_storage().data_ptr())
                labels = batch.labels.numpy()
                message = ("batch", token, seq, slot, len(labels), labels, batch.bad)
                # Before sending: once sent, the parent may free the slot and a
                # decoding thread take it again.
                slots.handed_over(slot)
                send_message(sock, lock, message)
        except EpochStopped:
            pass
        except Exception as e:
            if not stop.is_set():
                message = ("error", token, type(e).__name__, str(e))
                send_message(sock, lock, (*message, traceback.format_exc()))
        finally:
            # The epoch is over: threads waiting for a slot leave, and closing the
            # engine waits for the running ones; then the slots of the batches
            # decoded or being decoded, and not sent, are free again.
            stop.set()
            slots.wake()
            if engine is not None:
                engine.close()
            slots.reclaim()


def _watch_parent(parent_pid):
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def main(argv: list[str]) -> None:
    """The child's main thread: reads the parent's messages until its socket closes."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    fd, threads, prefetch, stats_period = argv
    sock = socket.socket(fileno=int(fd))
    lock = threading.Lock()
    import torch

    # The decoding threads are the parallelism; torch must not add a team per thread.
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, handlers=[_ForwardLogs(sock, lock)])
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    slots, jobs = Slots(), queue.Queue()
    stop = threading.Event()
    decoder, token = None, None
    runner = threading.Thread(
        target=_run_epochs,
        args=(
            sock,
            lock,
            slots,
            jobs,
            int(threads),
            int(prefetch),
            float(stats_period),
        ),
        daemon=True,
    )
    runner.start()
    send_message(sock, lock, ("ready", os.getpid()))
    try:
        while True:
            message, fds = recv_message(sock)
            kind = message[0]
            if kind == "free":
                slots.free(message[1])
            elif kind == "epoch":
                _, token, epoch, items = message
                stop.set()  # the epoch before, if still running
                slots.wake()
                stop = threading.Event()
                jobs.put((token, epoch, decoder, items, stop))
            elif kind == "stop" and message[1] == token:
                stop.set()
                slots.wake()
            elif kind == "slots":
                for (slot, shape), fd_ in zip(message[1], fds, strict=True):
                    slots.add(slot, map_slot(fd_, shape))
            elif kind == "drop_slots":
                slots.drop_all()
            elif kind == "decoder":
                decoder = message[1]
                decoder.pool, decoder.pin_memory = slots, False
    except (EOFError, OSError):
        pass
    # The parent is gone or done: leave at once (decoding threads may be mid-image).
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
