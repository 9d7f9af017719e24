"""Checkpoints written on a background thread (``ModelCheckpoint(async_save=True)``).

At the save point the checkpoint dict is made as for a synchronous save; :meth:`BackgroundWriter.submit`
then copies its tensors off the live state (into pinned CPU memory for CUDA tensors, asynchronously
on the current stream; a plain copy for CPU tensors) and its containers, and returns: training
continues while a thread writes the copy with ``checkpoint_io.write_atomic`` (temporary file, fsync,
rename) and then runs the caller's ``after`` step (links, rotation). A crash at any moment leaves
the previous file under the checkpoint's name, as for a synchronous write. The thread writes
through a Python file object: torch's writer for a path holds the GIL while it copies each
tensor's bytes, which would stop the training thread for most of the write.

Rules that keep it exact and bounded:

- At most one write is in flight: ``submit`` first waits for the previous one. The copy buffers are
  kept and reused by the next save when the sizes match, so saving every step does not allocate the
  model's size again each time.
- A failure of the write is kept and raised in the training thread by the next ``collect``/``wait``
  (the next save, a step boundary, the end of fit), never lost.
- The caller's ``on_done`` runs in the training thread once the write is complete, never in the
  background thread: the state that names the new files (best, last) is published only when they
  exist.
- CPU storages that only an optimizer's ``step`` changes (``defer``: parameters, optimizer states) are
  copied by the background thread, as byte tensors (whose ``copy_`` lets go of the GIL), while the
  training thread runs the next forward and backward; a global optimizer step pre-hook makes every
  optimizer's next ``step`` wait for them. Their versions (``Tensor._version``) are checked after the
  copy: a tensor changed in place meanwhile fails the save instead of writing a torn file.
- Every synchronous save waits for the write in flight first (``trainer.checkpoint.save`` calls
  :func:`writers_of` and :meth:`BackgroundWriter.wait`), so files are written in the order the saves
  were made.

Tensors are copied storage by storage, keeping their offsets, sizes and strides, so that views of
one storage stay views of one storage; containers are copied with their attributes (a module's
``state_dict`` carries ``_metadata``, the modules' versions), so the file holds what a synchronous
save's holds. The
copies are CPU tensors: a checkpoint of CUDA tensors written this way loads on the CPU unless a
``map_location`` says otherwise (ember's own loading always maps to the CPU first).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ember.checkpoint_io import write_atomic

#: ``after(write)`` runs on the background thread once the checkpoint is complete on disk; ``write(path)``
#: writes the same checkpoint atomically to another path.
After = Callable[[Callable[[str], None]], None]


class _Job:
    def __init__(self, obj: Any, path: str, events: list[Any], before_rename: Callable[[str], None] | None,
                 after: After | None, on_done: Callable[[], None] | None,
                 deferred: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] | None = None,
                 watched: list[tuple[torch.Tensor, int]] | None = None) -> None:
        self.obj: Any = obj
        self.path = path
        self.events = events
        self.before_rename = before_rename
        self.after = after
        self.on_done = on_done
        self.error: BaseException | None = None
        self.deferred = deferred or []  # (copy buffer, live storage) pairs this thread copies first
        self.watched = watched or []  # (live tensor, its version at the save point)
        self.copied = threading.Event()

    def run(self) -> None:
        try:
            try:
                for buf, src in self.deferred:
                    # As byte tensors: a tensor's copy_ lets go of the GIL while it copies (a storage's does
                    # not), so the training thread runs on meanwhile.
                    _bytes(buf).copy_(_bytes(src))
            finally:
                self.copied.set()
            self._check_unchanged()
            for event in self.events:  # the device -> pinned copies enqueued at the save point
                event.synchronize()
            write_atomic(self.obj, self.path, self.before_rename, background=True)
            if self.after is not None:
                self.after(lambda other: write_atomic(self.obj, other, background=True))
        except BaseException as err:  # kept for the training thread, which raises it
            self.error = err
        finally:
            self.obj = None  # the copy buffers stay with the writer, for the next save
            self.deferred, self.watched = [], []

    def _check_unchanged(self) -> None:
        """The deferred copies hold the state of the save point only if nothing changed those tensors in
        place before they were copied (the optimizer's step waits for the copies; anything else that
        writes into a parameter or an optimizer state in the meantime is caught here, as far as it
        finished before this check)."""
        changed = [t for t, version in self.watched if t._version != version]
        if changed:
            t = changed[0]
            raise RuntimeError(
                f"ModelCheckpoint(async_save=True): {len(changed)} parameter or optimizer-state tensor(s) "
                f"(the first of shape {tuple(t.shape)}) were changed in place after the save point, before the "
                f"background copy of them was complete, so {self.path} was not written (the previous file under "
                "that name is intact). Change parameters and optimizer states only in the optimizer's step, or "
                "use async_save=False.")


class BackgroundWriter:
    """Writes one checkpoint at a time on a background thread; see the module's docstring."""

    def __init__(self) -> None:
        self._job: _Job | None = None
        self._thread: threading.Thread | None = None
        self._buffers: list[torch.UntypedStorage] = []
        self._pin_failed = False  # pinned memory refused once: pageable buffers are reused, not retried
        self._claim: tuple[str, After | None, Callable[[], None] | None] | None = None
        self._step_hook: Any = None  # an optimizer step pre-hook waiting for deferred copies

    # ------------------------------------------------------------------ routing a save here
    @contextlib.contextmanager
    def claim(self, path: str, after: After | None = None,
              on_done: Callable[[], None] | None = None) -> Iterator[None]:
        """Within this block, the save of ``path`` (``trainer.save_checkpoint``) is written by this writer,
        with ``after`` and ``on_done`` as for :meth:`submit`. Raises if the block saved without asking
        ``trainer.checkpoint.save`` (every rank asks, rank zero submits)."""
        self._claim = (os.path.abspath(path), after, on_done)
        try:
            yield
            if self._claim is not None:
                raise RuntimeError(
                    f"ModelCheckpoint(async_save=True): the save of {path} did not go through ember's "
                    "Trainer.save_checkpoint (is it overridden?), so it was written synchronously and last.ckpt "
                    "and top-k rotation were not updated. Keep Trainer.save_checkpoint, or use async_save=False.")
        finally:
            self._claim = None

    def take(self, path: str) -> Callable[..., None] | None:
        """The submit function for a save of ``path`` claimed with :meth:`claim`, or None when none is."""
        if self._claim is None or self._claim[0] != os.path.abspath(path):
            return None
        _, after, on_done = self._claim
        self._claim = None

        def submit(obj: Any, target: str, before_rename: Callable[[str], None] | None = None,
                   defer: frozenset[int] = frozenset()) -> None:
            self.submit(obj, target, before_rename=before_rename, after=after, on_done=on_done, defer=defer)
        return submit

    # ------------------------------------------------------------------ writing
    @property
    def pending(self) -> bool:
        """Whether a write was submitted whose outcome the training thread has not collected yet."""
        return self._job is not None

    def submit(self, obj: Any, path: str, before_rename: Callable[[str], None] | None = None,
               after: After | None = None, on_done: Callable[[], None] | None = None,
               defer: frozenset[int] = frozenset()) -> None:
        """Copy ``obj`` off the live state and write it to ``path`` on a background thread.

        Args:
            obj: the checkpoint (tensors, numbers, strings, lists and dicts).
            path: the file to write, atomically.
            before_rename: passed to ``write_atomic`` (tests use it to stop at the worst moment).
            after: run on the background thread once ``path`` is complete, with a function that writes the
                same checkpoint to another path.
            on_done: run in the training thread when the write (and ``after``) is collected successfully.
            defer: ``data_ptr()`` of CPU storages that only an optimizer's ``step`` changes (parameters,
                optimizer states): the background thread copies them, while training goes on, and every
                optimizer's next ``step`` first waits for those copies. Everything else is copied now.
        """
        self.wait()  # never two writes in flight; the buffers below are free again
        events: list[Any] = []
        deferred: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        watched: list[tuple[torch.Tensor, int]] = []
        copy = self._copy(obj, events, defer, deferred, watched)
        self._job = job = _Job(copy, os.path.abspath(path), events, before_rename, after, on_done, deferred, watched)
        if deferred:
            def wait_for_copies(optimizer: Any, args: Any, kwargs: Any) -> None:
                job.copied.wait()
            self._step_hook = register_optimizer_step_pre_hook(wait_for_copies)
        # Not a daemon: an interpreter that exits while a write is in flight finishes the write first.
        self._thread = threading.Thread(target=job.run, name="ember-checkpoint-writer")
        self._thread.start()

    def collect(self, raise_errors: bool = True) -> BaseException | None:
        """If the write in flight has finished: run its ``on_done``, or raise its error (return it instead
        with ``raise_errors=False``). Does not wait."""
        if self._step_hook is not None and self._job is not None and self._job.copied.is_set():
            # Removed here, in the training thread, not from the hook itself (torch is iterating over them then).
            self._step_hook.remove()
            self._step_hook = None
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
                job.error.add_note(f"(raised by the background write of the checkpoint {job.path}; the previous "
                                   "file under that name, if any, is intact)")
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
    def _copy(self, obj: Any, events: list[Any], defer: frozenset[int] = frozenset(),
              deferred: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] | None = None,
              watched: list[tuple[torch.Tensor, int]] | None = None) -> Any:
        memo: dict[tuple[Any, ...], torch.UntypedStorage] = {}
        slot = itertools.count()
        devices: set[torch.device] = set()

        def storage_copy(src: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
            key = (device, src.data_ptr(), src.nbytes())
            found = memo.get(key) if src.nbytes() else None
            if found is not None:
                return found  # another view of a storage copied already: stays a view of the same copy
            i, n, pin = next(slot), src.nbytes(), device.type == "cuda"
            if i < len(self._buffers) and self._buffers[i].nbytes() == n and (
                    not pin or self._pin_failed or self._buffers[i].is_pinned()):
                buf = self._buffers[i]
            else:
                buf = _allocate(n, pin)
                self._pin_failed = self._pin_failed or (pin and not buf.is_pinned())
                if i < len(self._buffers):
                    self._buffers[i] = buf
                else:
                    self._buffers.append(buf)
            if deferred is not None and device.type == "cpu" and src.data_ptr() in defer:
                deferred.append((buf, src))  # copied by the background thread, before the next optimizer step
            else:
                buf.copy_(src, non_blocking=pin and buf.is_pinned())
            if pin:
                devices.add(device)
            memo[key] = buf
            return buf

        def walk(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                if watched is not None and x.device.type == "cpu" and x.layout == torch.strided and \
                        x.untyped_storage().data_ptr() in defer:
                    watched.append((x, x._version))
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


def _copy_tensor(t: torch.Tensor, storage_copy: Callable[[torch.UntypedStorage, torch.device],
                                                         torch.UntypedStorage]) -> torch.Tensor:
    if t.device.type == "meta":
        return t  # no data to change under the writer
    if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_quantized
            or t.device.type not in ("cpu", "cuda")):
        return t.detach().to("cpu", copy=True)  # no plain storage to copy: a copy of the values
    buf = storage_copy(t.untyped_storage(), t.device)
    out = torch.empty(0, dtype=t.dtype).set_(buf, t.storage_offset(), t.size(), t.stride())
    # Lazy conjugate and negative views keep their bit over the raw storage, as torch.save keeps it.
    if t.is_conj():
        out = out.conj()
    if t.is_neg():
        out = out._neg_view()
    if type(t) is torch.nn.Parameter:
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad)


def writers_of(callbacks: Iterable[Any]) -> list[BackgroundWriter]:
    """The background writers of ``callbacks`` (their ``background_writer`` attribute)."""
    return [w for cb in callbacks if isinstance(w := getattr(cb, "background_writer", None), BackgroundWriter)]
