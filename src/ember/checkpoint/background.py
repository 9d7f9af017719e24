"""Checkpoints written on a background thread (``ModelCheckpoint(async_save=True)``).

At the save point the checkpoint dict is made as for a synchronous save; :meth:`BackgroundWriter.submit`
(the strategy's ``background_writer``, which a save asks for with a ``BackgroundSave``, see
``writer.py``) then copies it off the live state and returns: training continues while a thread writes the copy with
``io.write_atomic`` (temporary file, fsync, rename) and then runs the caller's ``after`` step
(links, rotation). A crash at any moment leaves the previous file under the checkpoint's name, as for
a synchronous write. The thread writes through a Python file object: torch's writer for a path holds
the GIL while it copies each tensor's bytes, which would stop the training thread for most of the write.

The rule that makes a background file the file a synchronous save at the same point writes: **every
byte is taken before** ``submit`` **returns to the caller**, that is before any of the user's code runs
again. CPU storages are copied there, in the training thread (as byte tensors, whose ``copy_`` lets go of
the GIL). CUDA storages are copied into pinned CPU memory by a copy
enqueued there on the current stream: whatever writes into the tensor afterwards (an optimizer step, a
``no_grad`` in-place op, ``.data``, a buffer update) is a kernel enqueued after it on that stream, or on a
stream that waits for it as CUDA requires of any other stream, so it cannot reach the copy; the background
thread waits for the copy's event before it reads, and keeps the source storages alive until then (a freed
block could otherwise be reused by an allocation on another stream). After ``submit`` returns, the writer
reads only its copy.

Why nothing is copied later, while the next step runs: no check can tell afterwards that a tensor was
left alone. ``Tensor._version`` does not count writes through ``.data`` (nor through numpy or any other
alias), and counts an in-place op only once the op has finished, so a write running beside the copy
passes the check and tears the file. Nor does "only the optimizer's step changes it" hold of any
tensor: a frozen teacher updated by EMA, weight clipping in ``training_step`` before the forward, a
callback's ``on_train_batch_start`` or ``on_train_batch_end`` all write parameters before the next
``step``. Copying later could only be checked by reading every byte at the save point, which costs what
the copy costs.

Rules that keep it exact and bounded:

- At most one write is in flight: ``submit`` first waits for the previous one. The copy buffers are
  kept and reused by the next save when the sizes match, so saving every step does not allocate the
  model's size again each time.
- A failure of the write is kept and raised in the training thread by the next ``collect``/``wait``
  (the next save, a step boundary, the end of fit), never lost.
- The caller's ``on_done`` runs in the training thread once the write is complete, never in the
  background thread: the state that names the new files (best, last) is published only when they
  exist.
- Every save waits for the write in flight first (``ember.checkpoint.contents.save`` calls the
  strategy's ``background_writer.wait()`` before it reads the state), so files are written in the
  order the saves were made.

Tensors are copied storage by storage, keeping their offsets, sizes and strides, so that views of
one storage stay views of one storage; containers are copied with their attributes (a module's
``state_dict`` carries ``_metadata``, the modules' versions), so the file holds what a synchronous
save's holds. The copies are CPU tensors: a checkpoint of CUDA tensors written this way loads on the
CPU unless a ``map_location`` says otherwise (ember's own loading always maps to the CPU first).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from ember.checkpoint.atomic import write_atomic
from ember.checkpoint.writer import After, CheckpointWriter


class _Job:
    def __init__(
        self,
        obj: Any,
        path: str,
        events: list[Any],
        sources: list[torch.UntypedStorage],
        before_rename: Callable[[str], None] | None,
        after: After | None,
        on_done: Callable[[], None] | None,
    ) -> None:
        self.obj: Any = obj
        self.path = path
        self.events = events
        self.sources = sources  # CUDA storages whose copies ``events`` wait for
        self.before_rename = before_rename
        self.after = after
        self.on_done = on_done
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for event in self.events:  # the device -> pinned copies enqueued at the save point
                event.synchronize()
            self.sources = []
            write_atomic(self.obj, self.path, self.before_rename, background=True)
            if self.after is not None:
                self.after(lambda other: write_atomic(self.obj, other, background=True))
        except BaseException as err:  # kept for the training thread, which raises it
            self.error = err
        finally:
            self.obj, self.sources = None, []  # the copy buffers stay with the writer, for the next save


class BackgroundWriter(CheckpointWriter):
    """Writes one checkpoint at a time on a background thread; see the module's docstring."""

    def __init__(self) -> None:
        self._job: _Job | None = None
        self._thread: threading.Thread | None = None
        self._buffers: list[torch.UntypedStorage] = []
        self._pin_failed = False  # pinned memory refused once: pageable buffers are reused, not retried

    # ------------------------------------------------------------------ writing
    @property
    def pending(self) -> bool:
        """Whether a write was submitted whose outcome the training thread has not collected yet."""
        return self._job is not None

    def write(
        self,
        obj: Any,
        path: str,
        before_rename: Callable[[str], None] | None = None,
        after: After | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """The writer interface (``writer.py``): :meth:`submit`."""
        self.submit(obj, path, before_rename=before_rename, after=after, on_done=on_done)

    def submit(
        self,
        obj: Any,
        path: str,
        before_rename: Callable[[str], None] | None = None,
        after: After | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Copy ``obj`` off the live state, then write it to ``path`` on a background thread.

        Returns once every byte of ``obj`` is copied (CUDA tensors: once the copies are enqueued on the
        current stream), so nothing the caller does to its tensors afterwards can change the file.

        Args:
            obj: the checkpoint (tensors, numbers, strings, lists and dicts).
            path: the file to write, atomically.
            before_rename: passed to ``write_atomic`` (tests use it to stop at the worst moment).
            after: run on the background thread once ``path`` is complete, with a function that writes the
                same checkpoint to another path.
            on_done: run in the training thread when the write (and ``after``) is collected successfully.
        """
        self.wait()  # never two writes in flight; the buffers below are free again
        events: list[Any] = []
        sources: list[torch.UntypedStorage] = []
        copy = self._copy(obj, events, sources)
        self._job = job = _Job(copy, os.path.abspath(path), events, sources, before_rename, after, on_done)
        # Not a daemon: an interpreter that exits while a write is in flight finishes the write first.
        self._thread = threading.Thread(target=job.run, name="ember-checkpoint-writer")
        self._thread.start()

    def collect(self, raise_errors: bool = True) -> BaseException | None:
        """If the write in flight has finished: run its ``on_done``, or raise its error (return it instead
        with ``raise_errors=False``). Does not wait."""
        if self._job is None or (self._thread is not None and self._thread.is_alive()):
            return None
        job, self._job = self._job, None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if job.error is not None:
            if not raise_errors:
                return job.error
            if hasattr(job.error, "add_note"):
                job.error.add_note(
                    f"(raised by the background write of the checkpoint {job.path}; the previous "
                    "file under that name, if any, is intact)"
                )
            raise job.error
        if job.on_done is not None:
            job.on_done()
        return None

    def wait(self, raise_errors: bool = True) -> BaseException | None:
        """Wait for the write in flight, then :meth:`collect` it."""
        if self._thread is not None:
            self._thread.join()
        return self.collect(raise_errors)

    def close(self, raise_errors: bool = False) -> BaseException | None:
        """Wait for the write in flight and free the copy buffers (the end of a fit)."""
        try:
            return self.wait(raise_errors)
        finally:
            self._buffers = []

    # ------------------------------------------------------------------ copying
    def _copy(self, obj: Any, events: list[Any], sources: list[torch.UntypedStorage]) -> Any:
        """A copy of ``obj`` that shares no tensor storage and no container with it, complete (CPU) or
        enqueued on the current stream (CUDA: one event per device appended to ``events``, and the source
        storages to ``sources``) on return."""
        memo: dict[tuple[Any, ...], torch.UntypedStorage] = {}
        slot = itertools.count()
        devices: set[torch.device] = set()

        def storage_copy(src: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
            key = (device, src.data_ptr(), src.nbytes())
            found = memo.get(key) if src.nbytes() else None
            if found is not None:
                return found  # another view of a storage copied already: stays a view of the same copy
            i, n, pin = next(slot), src.nbytes(), device.type == "cuda"
            if (
                i < len(self._buffers)
                and self._buffers[i].nbytes() == n
                and (not pin or self._pin_failed or self._buffers[i].is_pinned())
            ):
                buf = self._buffers[i]
            else:
                buf = _allocate(n, pin)
                self._pin_failed = self._pin_failed or (pin and not buf.is_pinned())
                if i < len(self._buffers):
                    self._buffers[i] = buf
                else:
                    self._buffers.append(buf)
            if pin:
                buf.copy_(src, non_blocking=buf.is_pinned())  # ordered before any later kernel on the stream
                devices.add(device)
                sources.append(src)
            else:
                _bytes(buf).copy_(_bytes(src))  # lets go of the GIL while it copies (a storage's copy_ does not)
            memo[key] = buf
            return buf

        def walk(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return _copy_tensor(x, storage_copy)
            out: Any
            if isinstance(x, dict):
                out = type(x)({k: walk(v) for k, v in x.items()})
            elif isinstance(x, (list, tuple)):
                out = type(x)(walk(v) for v in x)
            else:
                return x  # numbers, strings, dtypes, devices, sizes: immutable
            # Attributes pickle with the container (a state_dict's ``_metadata``: its modules' versions).
            for name, value in getattr(x, "__dict__", {}).items():
                setattr(out, name, walk(value))
            return out

        out = walk(obj)
        for device in devices:  # the background thread waits for these before reading the buffers
            events.append(torch.cuda.current_stream(device).record_event())
        return out


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def _allocate(nbytes: int, pin: bool) -> torch.UntypedStorage:
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
        except RuntimeError:  # pinning refused (limits, no driver): a pageable copy, synchronous
            pass
    return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()


def _copy_tensor(
    t: torch.Tensor, storage_copy: Callable[[torch.UntypedStorage, torch.device], torch.UntypedStorage]
) -> torch.Tensor:
    if t.device.type == "meta":
        return t  # no data to change under the writer
    if (
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.layout != torch.strided
        or t.is_quantized
        or t.device.type not in ("cpu", "cuda")
    ):
        return t.detach().to("cpu", copy=True)  # no plain storage to copy: a copy of the values
    buf = storage_copy(t.untyped_storage(), t.device)
    out = torch.empty(0, dtype=t.dtype).set_(buf, t.storage_offset(), t.size(), t.stride())
    # Lazy conjugate and negative views keep their bit over the raw storage, as torch.save keeps it.
    if t.is_conj():
        out = out.conj()
    if t.is_neg():
        # torch has no public name for a negative view (torch.save keeps the bit the same way).
        out = out._neg_view()  # noqa: SLF001
    if type(t) is torch.nn.Parameter:
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad)
