"""What runs inside every process for fit / validate / test / predict, as a Trainer mixin.

Kept apart from ``trainer.py`` (arguments and public state) so each file reads as one thing:
this one is the order of setup, loop and teardown work, and the logging that feeds loggers.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import TYPE_CHECKING, Any

from ember.data import DataModule
from ember.module import TrainModule
from ember.trainer import checkpoint, evaluation, loops
from ember.trainer.metrics import MetricCollector
from ember.trainer.optim import OptimizerState, parse_optimizers
from ember.trainer.preemption import preemption
from ember.trainer.progress import FitProgress
from ember.utils import move_to_device, to_floats

if TYPE_CHECKING:
    pass


class _Runs:
    """The run-time half of ``Trainer``."""

    # ------------------------------------------------------------------ the runs (inside every process)
    def _attach(self, module: TrainModule, datamodule: DataModule | None) -> None:
        self.module = module
        self.datamodule = datamodule
        module.trainer = self
        # Each fit / validate / test / predict starts from empty metrics, as in Lightning.
        self._metrics = MetricCollector(self.strategy)
        self.logged_metrics = {}
        module._log_sink = self._metrics
        if datamodule is not None:
            datamodule.trainer = self
        extra = list(module.configure_callbacks() or [])
        if extra:
            types = {type(c) for c in extra}
            self.callbacks = [c for c in self.callbacks if type(c) not in types] + extra
        self._hook_table = {}

    def _prepare(self, stage: str, module: TrainModule, datamodule: DataModule | None,
                 ckpt_path: str | os.PathLike | None = None) -> str | None:
        """Everything before the loaders are built; returns the checkpoint file to restore, if any."""
        self._attach(module, datamodule)
        self.strategy.setup_environment()
        if self.strategy.local_rank == 0:
            if datamodule is not None:
                datamodule.prepare_data()
            if type(module).prepare_data is not TrainModule.prepare_data:
                module.prepare_data()
        self.strategy.barrier("prepare_data")
        # "last" is resolved before the loggers' and callbacks' setup: a fit continuing a run's
        # last.ckpt continues writing into that run's directory.
        path = checkpoint.resolve(self, ckpt_path, continue_run=stage == "fit") if ckpt_path is not None else None
        if datamodule is not None:
            datamodule.setup(stage=stage)
        hooks = self._hooks("setup")
        if hooks:
            self._metrics.fx = "setup"
            for h in hooks:
                # By keyword, as Lightning: ``def setup(self, stage)`` and ``(self, stage=None)`` both work.
                h(stage=stage)
        if type(module).configure_model is not TrainModule.configure_model:
            self._metrics.fx = "configure_model"
            module.configure_model()
        return path

    def _loader(self, given: Any, stage: str, attr: str) -> Any:
        if given is not None:
            return given
        source = self.datamodule if self.datamodule is not None else self.module
        fn = getattr(source, attr, None)
        return fn() if callable(fn) else None

    def _run_fit(self, module: TrainModule, train: Any, val: Any, datamodule: DataModule | None,
                 ckpt_path: str | None) -> None:
        try:
            ckpt_path = self._prepare("fit", module, datamodule, ckpt_path)
            self._given_loaders = (train, val)
            self._train_loader = None
            if not module.automatic_optimization and (self.accumulate_grad_batches > 1 or self.gradient_clip_val):
                raise ValueError("accumulate_grad_batches and gradient_clip_val apply to automatic optimization only; "
                                 "with automatic_optimization=False, accumulate and clip in training_step yourself.")
            self._precision.convert_module(module)
            # Resuming: the weights first, before configure_optimizers (as Lightning); the rest after on_fit_start.
            early = checkpoint.restore_weights(self, ckpt_path) if ckpt_path is not None else None
            self.strategy.setup(self, module)
            if type(module).configure_optimizers is TrainModule.configure_optimizers:
                module.configure_optimizers()  # raises the explanatory NotImplementedError
            optimizers, schedulers = parse_optimizers(module.configure_optimizers())
            if module.automatic_optimization and len(optimizers) != 1:
                raise ValueError(f"configure_optimizers returned {len(optimizers)} optimizers; automatic optimization "
                                 "needs exactly one. For several, set self.automatic_optimization = False and step "
                                 "them in training_step.")
            self._optim = OptimizerState(self, optimizers, schedulers)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            self.should_stop = False
            self.history = []
            self.progress = FitProgress()
            self._call("on_fit_start")
            self._log_hyperparams()
            # The loaders are requested after on_fit_start, as in Lightning (earlier only when
            # configure_optimizers reads trainer.estimated_stepping_batches).
            self._load_fit_loaders()
            if early is not None:
                checkpoint.restore(self, ckpt_path, early=early)
            # No module.train() here: as in Lightning, submodules a user put in eval mode stay there.
            with preemption(self):  # SIGTERM -> checkpoint at the next step boundary -> Preempted exit
                self._loop.run()
            self._call("on_fit_end")
            self._finalize_loggers("success")
        except BaseException as exc:
            self._on_exception(exc)
            raise
        finally:
            self._teardown("fit")

    def _run_eval(self, stage: str, module: TrainModule, dataloaders: Any, datamodule: DataModule | None,
                  ckpt_path: str | None) -> list[dict[str, float]]:
        hook = "validation" if stage == "validate" else "test"
        try:
            ckpt_path = self._prepare(stage, module, datamodule, ckpt_path)
            if getattr(type(module), f"{hook}_step") in (None, getattr(TrainModule, f"{hook}_step")):
                raise ValueError(f"{type(module).__name__} defines no {hook}_step; define it to {stage}.")
            attr = "val_dataloader" if stage == "validate" else "test_dataloader"
            loaders = self._as_list(self._loader(dataloaders, stage, attr))
            if not loaders:
                raise ValueError(f"{stage} needs data: pass dataloaders or a datamodule.")
            loaders = [self.strategy.process_dataloader(d, stage) for d in loaders]
            limit = self.limit_val_batches if stage == "validate" else self.limit_test_batches
            limits = [loops.num_batches(d, limit) for d in loaders]
            self._precision.convert_module(module)
            self.strategy.setup(self, module)
            if ckpt_path is not None:
                self._restore(ckpt_path)
            results = evaluation.run_evaluation_loop(self, stage, loaders, limits)
            if self.loggers and self.is_global_zero:
                # Through _write_logs, like fit's metrics: adds "epoch" and fills trainer.logged_metrics.
                self._write_logs({k: v for r in results for k, v in r.items()})
            return results
        except BaseException as exc:
            self._on_exception(exc)
            raise
        finally:
            self._teardown(stage)

    def _run_predict(self, module: TrainModule, dataloaders: Any, datamodule: DataModule | None,
                     ckpt_path: str | None) -> list[Any]:
        try:
            ckpt_path = self._prepare("predict", module, datamodule, ckpt_path)
            loaders = self._as_list(self._loader(dataloaders, "predict", "predict_dataloader"))
            if not loaders:
                raise ValueError("predict needs data: pass dataloaders or a datamodule.")
            loaders = [self.strategy.process_dataloader(d, "predict") for d in loaders]
            limits = [loops.num_batches(d, self.limit_predict_batches) for d in loaders]
            self._precision.convert_module(module)
            self.strategy.setup(self, module)
            if ckpt_path is not None:
                self._restore(ckpt_path)
            results = evaluation.run_predict_loop(self, loaders, limits)
            return results[0] if len(results) == 1 else results
        except BaseException as exc:
            self._on_exception(exc)
            raise
        finally:
            self._teardown("predict")

    def _run_evaluation(self, stage: str) -> None:
        """Validation inside fit (``stage`` "validate") or the sanity check before it ("sanity")."""
        if stage == "sanity":
            saved = (dict(self._metrics.callback_metrics), dict(self._metrics.progress_bar_metrics))
            self.sanity_checking = True
            self._call("on_sanity_check_start")
            limits = [min(n, self.num_sanity_val_steps) for n in self.num_val_batches]
            try:
                evaluation.run_evaluation_loop(self, "sanity", self._val_loaders, limits)
            finally:
                self.sanity_checking = False
                self._metrics.callback_metrics, self._metrics.progress_bar_metrics = saved
            self._call("on_sanity_check_end")
            return
        evaluation.run_evaluation_loop(self, "validate", self._val_loaders, self.num_val_batches)
        self.progress.val_checks_in_epoch += 1
        if self.loggers and self.is_global_zero:
            keys = self._metrics.logger_keys()
            epoch_vals = {k: v for k, v in self._metrics.callback_metrics.items() if k in keys}
            if epoch_vals:
                self._write_logs(epoch_vals)

    def _check_val_interval(self) -> None:
        v = self.val_check_interval
        if isinstance(v, int) and self.check_val_every_n_epoch is not None and self._val_loaders \
                and self.num_training_batches != math.inf and v > self.num_training_batches:
            raise ValueError(f"val_check_interval={v} is larger than the {int(self.num_training_batches)} training "
                             "batches per epoch, so validation would never run. Lower it, or set "
                             "check_val_every_n_epoch=None to count batches across epochs.")
        if isinstance(v, float) and v != 1.0 and self._val_loaders and self.num_training_batches == math.inf:
            raise ValueError(f"val_check_interval={v} is a fraction of an epoch, but the train dataloader has no "
                             "length, so validation would never run mid-epoch. Pass an int number of batches, or an "
                             "int limit_train_batches.")

    def _val_due(self, batch_idx: int, is_last: bool) -> bool:
        if not self._val_loaders or not any(self.num_val_batches):
            return False
        epoch = self.progress.current_epoch
        if self.check_val_every_n_epoch is not None and (epoch + 1) % self.check_val_every_n_epoch:
            return False
        v = self.val_check_interval
        if isinstance(v, float):
            if self.num_training_batches == math.inf:
                return is_last and v == 1.0
            every = max(1, int(self.num_training_batches * v))
            return (batch_idx + 1) % every == 0 or (is_last and v == 1.0)
        if self.check_val_every_n_epoch is None:
            return self.progress.total_batches % v == 0
        return (batch_idx + 1) % v == 0

    def _val_due_at_epoch_end(self) -> bool:
        """Whether this epoch validates at its end (used when training stops before the end)."""
        if not self._val_loaders or not any(self.num_val_batches) or not isinstance(self.val_check_interval, float):
            return False
        n = self.check_val_every_n_epoch
        return n is not None and (self.progress.current_epoch + 1) % n == 0

    def _load_fit_loaders(self) -> None:
        """Request fit's loaders from the module or datamodule (once per fit) and count their batches."""
        if self._train_loader is not None:
            return
        module = self.module
        train, val = getattr(self, "_given_loaders", (None, None))
        # ``validation_step = None`` in a module means "no validation" (Lightning's way to switch it off).
        validates = getattr(type(module), "validation_step", None) is not None and self.limit_val_batches != 0
        # Requested in Lightning's order: the validation loader first when a sanity check will use it.
        val_first = validates and bool(self.num_sanity_val_steps)
        if val_first:
            val = self._loader(val, "fit", "val_dataloader")
        train = self._loader(train, "fit", "train_dataloader")
        if train is None:
            raise ValueError("fit needs training data: pass train_dataloaders, or a datamodule with "
                             "train_dataloader().")
        if not validates:
            val = None
        elif not val_first:
            val = self._loader(val, "fit", "val_dataloader")
        val_loaders = self._as_list(val)
        if val_loaders and type(module).validation_step is TrainModule.validation_step:
            raise ValueError(f"Validation data was given but {type(module).__name__} defines no validation_step. "
                             "Define validation_step or do not pass val_dataloaders.")
        self._train_loader = self.strategy.process_dataloader(train, "fit")
        self._val_loaders = [self.strategy.process_dataloader(v, "validate") for v in val_loaders]
        self.num_training_batches = loops.num_batches(self._train_loader, self.limit_train_batches)
        if self.num_training_batches == 0:
            raise ValueError("The train dataloader is empty (0 batches after limit_train_batches). Check the "
                             "dataset, batch_size with drop_last, and limit_train_batches.")
        self.num_val_batches = [loops.num_batches(v, self.limit_val_batches) for v in self._val_loaders]
        self._check_val_interval()

    def _reload_loaders(self) -> None:
        """``reload_dataloaders_every_n_epochs``: ask the module / datamodule for fresh loaders (loaders
        passed to ``fit`` directly are kept)."""
        train, val = getattr(self, "_given_loaders", (None, None))
        if train is None:
            loader = self._loader(None, "fit", "train_dataloader")
            if loader is not None:
                self._train_loader = self.strategy.process_dataloader(loader, "fit")
                self.num_training_batches = loops.num_batches(self._train_loader, self.limit_train_batches)
        if val is None and self._val_loaders:
            loaders = self._as_list(self._loader(None, "fit", "val_dataloader"))
            self._val_loaders = [self.strategy.process_dataloader(v, "validate") for v in loaders]
            self.num_val_batches = [loops.num_batches(v, self.limit_val_batches) for v in self._val_loaders]

    def _transfer(self, dataloader_idx: int) -> Any:
        """The batch transfer for loader ``dataloader_idx``: the strategy's (casting under 64-true), wrapped in
        the module's ``on_before_batch_transfer`` / ``transfer_batch_to_device`` / ``on_after_batch_transfer``
        where it overrides them (otherwise nothing extra runs per batch)."""
        base = self.strategy.batch_to_device if self._input_dtype is None else self._batch_to_device

        def owner(name: str) -> Any:
            """Whose hook ``name`` runs: the datamodule's where it overrides it, else the module's, or None."""
            dm = self.datamodule
            if dm is not None and getattr(type(dm), name) is not getattr(DataModule, name):
                return getattr(dm, name)
            if getattr(type(self.module), name) is not getattr(TrainModule, name):
                return getattr(self.module, name)
            return None
        before = owner("on_before_batch_transfer")
        custom = owner("transfer_batch_to_device")
        after = owner("on_after_batch_transfer")
        if before is None and custom is None and after is None:
            return base
        device = self.strategy.root_device

        def transfer(batch: Any) -> Any:
            if before is not None:
                batch = before(batch, dataloader_idx)
            batch = custom(batch, device, dataloader_idx) if custom is not None else base(batch)
            if after is not None:
                batch = after(batch, dataloader_idx)
            return batch
        return transfer

    def _batch_to_device(self, batch: Any) -> Any:
        """The strategy's transfer, or (64-true) a transfer that also casts floating tensors."""
        if self._input_dtype is None:
            return self.strategy.batch_to_device(batch)
        return move_to_device(batch, self.strategy.root_device, self._input_dtype)

    @staticmethod
    def _as_list(loaders: Any) -> list[Any]:
        if loaders is None:
            return []
        return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]

    def _set_loader_epoch(self, loader: Any, epoch: int, start: int) -> None:
        sampler = getattr(loader, "sampler", None)
        batch_sampler = getattr(loader, "batch_sampler", None)
        for obj in (sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                return

    def _restore(self, path: str) -> None:
        checkpoint.restore_weights_only(self, path)

    def save_checkpoint(self, filepath: str, weights_only: bool = False) -> None:
        """Save the full training state (or only the weights) to ``filepath``, atomically, on rank zero."""
        checkpoint.save(self, filepath, weights_only=weights_only)

    # ------------------------------------------------------------------ logging
    def _log_step_metrics(self) -> None:
        pending = self._metrics.pending_step_logs
        if pending and self.is_global_zero:
            self._write_logs(pending)
        pending.clear()

    def _write_logs(self, metrics: dict[str, Any]) -> None:
        floats = to_floats(metrics)
        floats["epoch"] = float(self.progress.current_epoch)
        self.logged_metrics.update(floats)
        for lg in self.loggers:
            lg.log_metrics(floats, self.progress.global_step)

    def _record_epoch(self, epoch_metrics: dict[str, Any]) -> None:
        floats = to_floats(epoch_metrics) if epoch_metrics else {}
        row = {"epoch": self.progress.current_epoch, "step": self.progress.global_step}
        row.update(to_floats({k: v for k, v in self._metrics.callback_metrics.items()
                              if not k.endswith("_step")}))
        self.history.append(row)
        if self.loggers and self.is_global_zero:
            keys = self._metrics.logger_keys()
            logged = {k: v for k, v in floats.items() if k in keys}
            if logged:
                self._write_logs(logged)

    def _log_hyperparams(self) -> None:
        """Hand the module's (and datamodule's) ``hparams`` to every logger once per fit, on rank zero."""
        if not (self.loggers and self.is_global_zero):
            return
        params: dict[str, Any] = {}
        for source in (self.module, self.datamodule):
            hp = getattr(source, "hparams", None)
            if hp:
                params.update(hp)
        for lg in self.loggers:
            lg.log_hyperparams(params)

    def _finalize_loggers(self, status: str) -> None:
        if self.is_global_zero:
            for lg in self.loggers:
                lg.finalize(status)

    def _on_exception(self, exc: BaseException) -> None:
        for h in self._hooks("on_exception"):
            try:
                h(exc)
            except Exception as hook_exc:  # never hide the original error behind a hook's
                # Named by its owner's class: the repr of a bound hook would print the whole module.
                fn = getattr(h, "func", h)
                owner = type(getattr(fn, "__self__", None)).__name__
                warnings.warn(f"{owner}.on_exception raised {type(hook_exc).__name__}: {hook_exc} (while handling "
                              f"{type(exc).__name__}, which follows)", RuntimeWarning)
        self._finalize_loggers("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")

    def _teardown(self, stage: str) -> None:
        try:
            if self.module is not None:
                for h in self._hooks("teardown"):
                    h(stage=stage)
            if self.datamodule is not None:
                self.datamodule.teardown(stage=stage)
        finally:
            self.strategy.teardown()
            self.state = "finished"
