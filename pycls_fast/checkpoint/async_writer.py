"""Asynchronous checkpoint writes (TRAIN.CHECKPOINT_ASYNC): training stalls only
while the state is copied to host memory; the write runs beside training.

    stager = HostStager(pin=device.type == "cuda")   # reuses its buffers
    write = FileWrite(write_fn, stager.stage(state))          # a writer thread
    write = FileWrite(write_fn, state, stager.stage)          # staged by it too
    write.wait_staged()   # before the next optimizer step (staged by the thread)
    write = ShardedWrite(path, dcp_future, publish)           # DCP's async_save
    write.done()      # finished (no collective: files only)
    write.wait()      # the path written, or the write's exception raised

A single-file checkpoint is staged by copying every tensor to host memory (buffers
reused from one save to the next, pinned on a GPU, so that the copies run at memory
speed and page faults and pinning are paid once), then written by a thread with the same
atomic write as a synchronous save (temporary name, fsync, rename): a kill at any
moment leaves either the complete file or a temporary one that the next start
deletes, and the newest complete checkpoint is the previous one. On a CPU the copy
itself runs in the writer thread too, beside the next step's forward and backward
(which only read the weights): the training loop waits for it only before the
optimizer step changes them (`wait_staged`). On a GPU the copy is made at the save
(pinned device-to-host copies take a fraction of a second for GBs).

A sharded checkpoint is DCP's `async_save` into `<name>.tmp`; it becomes `<name>`
(complete) only when every rank's write has finished and rank 0 renames it
(sharded.publish, a collective): at the next save, the end of an epoch or the end of
the run.
"""

import threading
from collections.abc import Callable
from typing import Any

import torch


class HostStager:
    """Copies a nested state (dicts, lists, tuples of tensors and plain values) to
    host memory; the copies are the checkpoint's, independent of training."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin and torch.cuda.is_available()
        # The host buffers, kept from one save to the next: a fresh allocation
        # would fault in (and, pinned, register) every page at each save, which
        # costs more than the copy. Reusing them is safe because a save waits for
        # the previous write to finish before staging.
        self._buffers: dict[str, torch.Tensor] = {}

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=self.pin and t.is_cuda)
        return buf

    def stage(self, state: Any) -> Any:
        """A host copy of `state` (waits for the device copies to finish)."""
        staged = self._walk(state, "")
        if self.pin:
            torch.cuda.synchronize()
        return staged

    def _walk(self, value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy(key, value)
        if isinstance(value, dict):
            return {k: self._walk(v, f"{key}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._walk(v, f"{key}/{i}") for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value


class FileWrite:
    """A single-file checkpoint written by a thread (rank 0), or nothing to write
    (other ranks: `write_fn` None).

    `write_fn(staged)` writes the staged state and returns the path. With
    `stage_fn`, the thread first stages `state` itself (`stage_fn(state)`), while
    training goes on: the caller must call `wait_staged()` before it changes any
    tensor of `state` in place (the optimizer step); without, `state` is staged."""

    def __init__(
        self,
        write_fn: Callable[[Any], str] | None,
        state: Any = None,
        stage_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        self.path: str | None = None
        self.error: BaseException | None = None
        # Whether the rank that wrote it has done its own part of completing it
        # (retention, upload) already, before the collective completion.
        self.completed = False
        self._staged = threading.Event()
        self._thread = None
        if write_fn is None:
            self._staged.set()
            return
        # Not a daemon: the interpreter does not exit before the write is done.
        self._thread = threading.Thread(
            target=self._run, args=(write_fn, state, stage_fn), name="checkpoint-writer"
        )
        self._thread.start()

    def _run(self, write_fn, state, stage_fn) -> None:
        try:
            try:
                staged = stage_fn(state) if stage_fn is not None else state
            finally:
                self._staged.set()
            del state
            self.path = write_fn(staged)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self.error = e

    def staged(self) -> bool:
        """Whether the state has been copied (training may change it)."""
        return self._staged.is_set()

    def wait_staged(self) -> None:
        """Blocks until the state has been copied."""
        self._staged.wait()

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str | None:
        """Blocks until written; returns the path (None on ranks that wrote
        nothing) or raises the write's error."""
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        return self.path


class ShardedWrite:
    """A sharded checkpoint being written by DCP's async_save on every rank."""

    def __init__(self, path: str, future, publish: Callable[[str], None]) -> None:
        self.path = path
        self.future = future
        self._publish = publish

    def done(self) -> bool:
        return self.future.done()

    def wait_local(self) -> None:
        """This rank's part is written (or failed: raises); no collective."""
        self.future.result()

    def wait(self) -> str:
        """Every rank: waits for its part, then the checkpoint is published (renamed
        complete by rank 0; collectives); returns its path."""
        self.wait_local()
        self._publish(self.path)
        return self.path
