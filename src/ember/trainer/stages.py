"""What a run does inside ``Trainer._run`` (``trainer.py``: prepare -> setup -> restore -> run -> teardown):
a fit's setup, resume and loop (``_fit``), validate / test / predict (``_evaluate_or_predict``), and what
every run does when it fails (``_on_exception``) and when it ends (``_teardown``).

A base class of ``Trainer``, as ``TrainerProperties`` is: it holds no state of its own. Resuming goes through
``ember.checkpoint.restore.Restore`` over the fit's parts (``trainer.fit_state``, ``state.py``), in
Lightning's moments: the ``"modules"`` parts here before ``configure_optimizers``, the ``"training"`` and
``"data"`` parts in ``FitLoop.run`` (``loops.py``); validate, test and predict restore the ``"modules"``
parts only.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any, cast

import torch

from ember.checkpoint.restore import Restore
from ember.module import TrainModule
from ember.overrides import is_overridden
from ember.signatures import takes_dataloader_iter
from ember.trainer.compile import is_compiled, unwrap_compiled
from ember.trainer.evaluation import EvaluationLoop
from ember.trainer.fit_summary import print_fit_summary
from ember.trainer.loaders import FitData, close_loaders, eval_loaders
from ember.trainer.loops import FitLoop
from ember.trainer.optim import NO_OPTIMIZER_WARNING, NoOptimizer, OptimizerState, check_scheduler_api, parse_optimizers
from ember.trainer.preemption import preemption
from ember.trainer.progress import FitProgress
from ember.trainer.properties import TrainerProperties
from ember.trainer.results_table import print_results
from ember.trainer.step import TrainingStep
from ember.user_frames import user_stacklevel

if TYPE_CHECKING:
    from ember.data import DataModule
    from ember.profilers import Profiler
    from ember.trainer.hooks import Hooks
    from ember.trainer.log_writer import LogWriter
    from ember.trainer.trainer import Trainer
    from ember.types import Stage

log = logging.getLogger(__name__)


class TrainerStages(TrainerProperties):
    """The stages of a run (a base class of ``Trainer``; it holds no state of its own)."""

    if TYPE_CHECKING:
        datamodule: DataModule | None
        ckpt_path: str | None
        profiler: Profiler
        should_stop: bool
        history: list[dict[str, float]]
        gradient_clip_val: float | None
        gradient_clip_algorithm: str
        detect_anomaly: bool
        enable_autolog_hparams: bool
        limit_val_batches: int | float
        limit_test_batches: int | float
        limit_predict_batches: int | float
        _hooks: Hooks
        _logs: LogWriter
        _input_dtype: Any
        _return_predictions: bool
        _verbose: bool
        _weights_only: bool

    def _fit(self, module: TrainModule, loaders: tuple[Any, ...], path: str | None) -> None:
        if not module.automatic_optimization and (self.accumulate_grad_batches > 1 or self.gradient_clip_val):
            raise ValueError(
                "accumulate_grad_batches and gradient_clip_val apply to automatic optimization only; "
                "with automatic_optimization=False, accumulate and clip in training_step yourself."
            )
        trainer = cast("Trainer", self)  # (this class is the Trainer's base: its collaborators take the Trainer)
        self.fit_state.start_fit(FitData(trainer, *loaders))
        self._data.warn_validation_step_without_data()
        if self._data.validates:  # (a fit without validation data never runs validation_step)
            self._refuse_dp_iter_steps(module, ("validation_step",))
        self._precision.convert_module(module)
        # Resuming, in Lightning's order (checkpoint/restore.py): the weights, the datamodule's and the callbacks'
        # states now, before configure_optimizers; the training state and the data position in FitLoop.run.
        resume = (
            Restore(
                self.fit_state,
                path,
                on_complete=lambda: self._resumed(path),
                strategy=self.strategy,
                weights_only=self._weights_only,
            )
            if path is not None
            else None
        )
        if resume is not None and not self.strategy.restore_after_setup:
            resume.load("modules")
        self.strategy.setup(trainer, module)
        if resume is not None and self.strategy.restore_after_setup:  # into the module as the strategy made it
            resume.load("modules")
        if not is_overridden("configure_optimizers", module, TrainModule):
            TrainModule.configure_optimizers(module)  # raises the explanatory NotImplementedError
        configured = module.configure_optimizers()
        if configured is None:  # as Lightning: warn, and train with a stand-in that updates nothing
            warnings.warn(f"{type(module).__name__}.{NO_OPTIMIZER_WARNING}.", UserWarning, stacklevel=user_stacklevel())
            configured = NoOptimizer()
        optimizers, schedulers = parse_optimizers(configured, module.automatic_optimization)
        self.strategy.setup_optimizers(optimizers)
        check_scheduler_api(schedulers, module)
        if module.automatic_optimization and len(optimizers) != 1:
            raise ValueError(
                f"configure_optimizers returned {len(optimizers)} optimizers; automatic optimization "
                "needs exactly one. For several, set self.automatic_optimization = False and step "
                "them in training_step."
            )
        self.fit_state.optim = OptimizerState(
            optimizers, schedulers, module=module, precision=self._precision, strategy=self.strategy, hooks=self._hooks
        )
        self.should_stop = False
        self.history = []
        self.fit_state.progress = FitProgress()
        step = TrainingStep(
            strategy=self.strategy,
            module=module,
            precision=self._precision,
            optim=self._optim,
            metrics=self._metrics,
            hooks=self._hooks,
            progress=self.progress,
            profiler=self.profiler,
            accumulate_grad_batches=self.accumulate_grad_batches,
            gradient_clip_val=self.gradient_clip_val,
            gradient_clip_algorithm=self.gradient_clip_algorithm,
        )
        evaluation = EvaluationLoop(trainer, module, self._hooks, self._metrics, self._precision, self._input_dtype)
        self._loop = FitLoop(
            trainer,
            hooks=self._hooks,
            metrics=self._metrics,
            optim=self._optim,
            data=self._data,
            logs=self._logs,
            evaluation=evaluation,
            step=step,
            input_dtype=self._input_dtype,
        )
        self._hooks.call("on_fit_start")
        if self.enable_autolog_hparams:
            self._logs.hyperparams()
        module.zero_grad()  # every stage starts without gradients, as Lightning's _run_stage
        # No module.train() here: as in Lightning, submodules a user put in eval mode stay there.
        with preemption(trainer) as handler, torch.autograd.set_detect_anomaly(self.detect_anomaly):
            self._preemption = handler
            self._loop.run(resume, handler)  # SIGTERM -> checkpoint at the next step boundary -> Preempted exit
        self._hooks.call("on_fit_end")
        self._logs.finalize("success")
        print_fit_summary(trainer)  # one line on rank zero: where the logs and checkpoints went

    def _evaluate_or_predict(self, stage: Stage, module: TrainModule, given: Any, path: str | None) -> Any:
        trainer = cast("Trainer", self)  # (this class is the Trainer's base: its collaborators take the Trainer)
        module.zero_grad()  # every stage starts without gradients, as Lightning's _run_stage
        attr, limit = {
            "validate": ("val_dataloader", self.limit_val_batches),
            "test": ("test_dataloader", self.limit_test_batches),
            "predict": ("predict_dataloader", self.limit_predict_batches),
        }[stage]
        if stage != "predict":
            hook = "validation" if stage == "validate" else "test"
            if not is_overridden(f"{hook}_step", module, TrainModule):
                raise ValueError(f"{type(module).__name__} defines no {hook}_step; define it to {stage}.")
        # A limit of 0 batches runs nothing, and (as Lightning) does not even request the loaders.
        loaders, limits = eval_loaders(trainer, given, stage, attr, limit) if limit != 0 else ([], [])
        self._eval_batches[stage] = limits
        self._eval_loaders[stage] = loaders
        self._precision.convert_module(module)
        self.strategy.setup(trainer, module)
        if path is not None:
            self._restore_for_evaluation(path)
        if stage != "predict" and self.enable_autolog_hparams:  # as Lightning; predict logs nothing at all
            self._logs.hyperparams()
        evaluation = EvaluationLoop(trainer, module, self._hooks, self._metrics, self._precision, self._input_dtype)
        if stage == "predict":
            outputs = evaluation.predict(loaders, limits, keep=self._return_predictions)
            if not self._return_predictions or not outputs:  # (no loader: limit_predict_batches=0)
                return None
            return outputs[0] if len(outputs) == 1 else outputs
        results = evaluation.run(stage, loaders, limits)
        # As Lightning: trainer.logged_metrics gets them with or without loggers; the loggers also get "epoch"
        # (and nothing at all when nothing was logged).
        logged = {k: v for r in results for k, v in r.items()}
        if logged:
            self._logs.write(logged)
        if self._verbose and self.is_global_zero:
            print_results(results, stage)
        return results

    def _on_exception(self, exc: BaseException) -> None:
        self.state.interrupt()  # as Lightning: any exception, before the hooks (trainer.interrupted is True there)
        for h in self._hooks.get("on_exception"):
            try:
                h(exc)
            except Exception as hook_exc:  # never hide the original error behind a hook's
                # Named by its owner's class: the repr of a bound hook would print the whole module.
                fn = getattr(h, "func", h)
                owner = type(getattr(fn, "__self__", None)).__name__
                warnings.warn(
                    f"{owner}.on_exception raised {type(hook_exc).__name__}: {hook_exc} (while handling "
                    f"{type(exc).__name__}, which follows)",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
        if self.datamodule is not None:  # after the callbacks and the module, as in Lightning
            try:
                self.datamodule.on_exception(exc)
            except Exception as hook_exc:
                warnings.warn(
                    f"{type(self.datamodule).__name__}.on_exception raised {type(hook_exc).__name__}: "
                    f"{hook_exc} (while handling {type(exc).__name__}, which follows)",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
        self._logs.finalize("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")

    def _teardown(self, stage: Stage) -> None:
        try:
            # The datamodule first, then callbacks and the module: the reverse of setup, as in Lightning.
            if self.datamodule is not None:
                self.datamodule.teardown(stage=stage)
            if self.module is not None:
                self._hooks.call("teardown", stage=stage)
        finally:
            try:
                # As Lightning: the worker processes of the stage's loaders end with it (persistent ones too).
                if stage == "fit":
                    self._data.close()
                else:
                    close_loaders(self._eval_loaders.get(stage, []))
                self.profiler.describe()  # the report: written to its file, or printed on rank zero
            finally:
                self.strategy.teardown()
                self.state.close()

    def _resumed(self, path: str) -> None:
        """A fit's resume from ``path`` is complete: the path is recorded and, as Lightning, named (ember adds
        where the run continues)."""
        self.ckpt_path = path
        if self.is_global_zero:
            p = self.progress
            log.info(
                "Restored all states from the checkpoint at %s (epoch %d, global step %d%s)",
                path,
                p.current_epoch,
                p.global_step,
                f", batch {p.batch_in_epoch} of the epoch" if p.batch_in_epoch else "",
            )

    def _restore_for_evaluation(self, path: str) -> None:
        """validate / test / predict with ``ckpt_path``, as Lightning: the module's ``on_load_checkpoint`` and
        weights, the datamodule's state, the callbacks' ``on_load_checkpoint`` and state (all or nothing).
        ``ckpt_path`` names the file while its hooks run, as Lightning's does."""
        previous, self.ckpt_path = self.ckpt_path, path
        try:
            Restore(
                self.fit_state, path, purpose="evaluate", strategy=self.strategy, weights_only=self._weights_only
            ).load("modules")
        except BaseException:
            self.ckpt_path = previous
            raise
        if self.is_global_zero:
            log.info("Loaded model weights from the checkpoint at %s", path)

    # ------------------------------------------------------------------ the module a run is given
    @staticmethod
    def _one_module(model: Any, module: Any, entry: str) -> Any:
        """The module passed to ``entry`` as ``model`` (Lightning's name, positional) or ``module=``."""
        if model is not None and module is not None:
            raise TypeError(f"Trainer.{entry} got both model= and module=: they name the same argument; pass one.")
        if model is None and module is None and entry == "fit":
            raise TypeError("Trainer.fit needs the module to train: trainer.fit(model, train_dataloaders, ...).")
        return model if model is not None else module

    def _module_for_eval(self, module: TrainModule | None, step: str) -> TrainModule:
        if module is None:
            if self.module is None:
                raise ValueError("No module given and none was fitted with this Trainer: pass the module.")
            module = self.module
        return self._check_module(module, (step,))

    def _check_module(self, module: Any, steps: tuple[str, ...]) -> TrainModule:
        """The TrainModule to run (the one inside a ``torch.compile`` result, compiled), checked for a run of
        ``steps``."""
        module = unwrap_compiled(module)
        if not isinstance(module, TrainModule):
            raise TypeError(f"Expected an ember.TrainModule, got {type(module).__name__}. Subclass ember.TrainModule.")
        if "_trainer" not in module.__dict__:  # set by TrainModule.__init__
            raise RuntimeError(f"{type(module).__name__}.__init__ did not call super().__init__(); call it first.")
        self._refuse_dp_iter_steps(module, steps)
        if is_compiled(module) and self.strategy.strategy_name == "dp":
            raise ValueError(
                "strategy='dp' cannot run a torch.compile'd module: its replicas would share the "
                "compiled steps of the original. Use strategy='single' or 'ddp', or pass the "
                "module uncompiled."
            )
        return module

    def _refuse_dp_iter_steps(self, module: TrainModule, steps: tuple[str, ...]) -> None:
        """Under dp, refuse any of ``steps`` (steps this run will call) that takes ``dataloader_iter``."""
        if self.strategy.strategy_name != "dp":
            return
        for step in steps:
            if takes_dataloader_iter(getattr(module, step, None)):
                raise ValueError(
                    f"strategy='dp' cannot run {type(module).__name__}.{step}(self, dataloader_iter): dp splits "
                    "each batch across the devices, and an iterator the step fetches its own batches from "
                    "cannot be split. Use strategy='ddp' (each process fetches its own batches) or 'single', "
                    f"or define {step}(self, batch, batch_idx) and let the Trainer fetch the batches."
                )
