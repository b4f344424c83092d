"""The pretraining loop (entry point: ``pretrain_lowrank.py``, ``megatron_boost/cli/pretrain.py``).

megatron-core has no training loop; this one is built from its pieces (``train/step.py``: DDP,
the megatron optimizer, the pipeline schedules), ``OptimizerParamScheduler``, the
num-microbatches calculator and ``dist_checkpointing`` (``train/checkpointing.py``). As in
megatron's ``training.py``, :meth:`Trainer.train` is a loop of named phases: train step,
training log (with evaluation), checkpoint and decide exit.

Learning rate: linear warmup over ``optimizer.warmup_iters``, then the decay of
``optimizer.lr_decay_style`` (cosine, linear, WSD) to ``optimizer.min_lr`` at
``optimizer.lr_decay_iters`` (default: the training length, so extending a run stretches it).
Iteration k (1-based) runs with the scheduler at step k, so the first update uses lr/warmup
(not 0) and the last one min_lr. On resume the configuration wins for every schedule parameter
(``override_opt_param_scheduler``); only the step count comes from the checkpoint.

Run directory (``logging.run_dir``): ``metrics.jsonl`` and ``tensorboard/``
(``train/metrics.py``), ``checkpoints/`` (default ``checkpoint.save``; a run resumes from the
checkpoint named there, or from ``checkpoint.load``; a new run may start from the weights of
``checkpoint.init_from``) and ``config.yaml``, the resolved run
(``config.resolved.resolved_config_yaml``: the vocabulary, device, precision and attention
backend as used). Pre-emption (SIGTERM, SIGUSR1, SIGINT; ``train/preemption.py``): all ranks agree at the
next step boundary, save, print ``pre-emption signal received, checkpoint saved at iteration
N`` and exit with status 0. The same clean stop ends a launch at ``training.exit_interval``
(every multiple of it) and after ``training.exit_duration_minutes`` (agreed through the
step's one all-reduce); neither changes the schedule, so the resumed run is the
uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    get_num_microbatches,
    init_num_microbatches_calculator,
)
from megatron.core.utils import get_attr_wrapped_model

from megatron_boost.analysis.comm import StepCommShape, step_comm_bytes
from megatron_boost.analysis.flops import flops_per_token
from megatron_boost.config.inert_settings import check_cuda_graphs
from megatron_boost.config.shape import ModelShape
from megatron_boost.config.resolved import resolve_run, resolved_config, resolved_config_yaml
from megatron_boost.config.validation import train_iterations
from megatron_boost.data.datasets import build_gpt_datasets, build_tokenizer, get_batch
from megatron_boost.data.validation import validate_data_files
from megatron_boost.runtime.backends import format_fusions
from megatron_boost.runtime.devices import peak_tflops
from megatron_boost.runtime.lifetime import forked_children_die_with_parent
from megatron_boost.train import step
from megatron_boost.train.build import build_run
from megatron_boost.train.callbacks import TrainerCallback
from megatron_boost.train.checkpoint_guard import TRACKER_FILE, iter_dir_name
from megatron_boost.train.checkpoint_writer import CheckpointWriter
from megatron_boost.train.checkpointing import (
    checkpoint_state_dict,
    find_checkpoint,
    load_checkpoint,
    load_weights,
    verify_checkpoint,
)
from megatron_boost.train.distributed import init_distributed, print0
from megatron_boost.train.metrics import (
    LogWindow,
    MetricsWriter,
    Progress,
    format_log_line,
    format_validation_line,
    peak_memory_bytes,
    validation_perplexity,
)
from megatron_boost.train.run_lock import RunLock
from megatron_boost.train.resilience import (
    RankMonitor,
    SkipBudget,
    StallWatch,
    collective_timeout,
    is_collective_failure,
    process_group_timeout,
    stall_barrier_window,
)
from megatron_boost.train.preemption import (
    PREEMPT_EXIT_CODE,
    install_signal_handlers,
    restore_signal_handlers,
    preemption_requested,
    signal_name,
)
from megatron_boost.train.sampler import make_data_iterator
from megatron_boost.train.state import TrainState

__all__ = ["train", "Trainer", "TrainingError"]


def train(cfg, device: str, on_stall=None, callbacks: Sequence[TrainerCallback] = ()) -> int:
    """Run (or resume) the training of ``cfg``, a RunConfig validated for this launch
    (``RunConfig.validate(world_size)``), on ``device`` ('cuda' or 'cpu'). Returns the exit
    status. On CUDA, ``on_stall(RankTimeout)`` is called from :class:`StallWatch`'s thread when
    a training step stalls (it must end the process; the entry point prints the error).
    ``callbacks`` are called at the run's named points (train/callbacks.py).
    It leaves what it set up as it found it: megatron's global micro-batch calculator is
    cleared and its signal handlers restored, so a process of one rank (a notebook, a script)
    can train again. A second run in the same torchrun-launched processes needs a rendezvous
    of its own (a new ``MASTER_PORT``): torch's store still holds the first run's keys."""
    forked_children_die_with_parent()  # megatron's forked checkpoint writers, DataLoader workers
    init_distributed(device, collective_timeout(cfg.parallel.timeout_minutes, device))
    previous_handlers = install_signal_handlers()
    lock = RunLock()  # taken by rank 0 once the inputs are checked, released however it ends
    try:
        trainer = Trainer(cfg, device, on_stall, lock, callbacks)  # ValueError = bad input
        try:
            return trainer.train()
        except ValueError as err:  # the inputs were checked: a fault, not a usage error
            raise TrainingError(f"training failed at iteration {trainer.state.iteration + 1}: "
                                f"{err}") from err
    finally:
        lock.release()
        destroy_num_microbatches_calculator()
        restore_signal_handlers(previous_handlers)


class TrainingError(RuntimeError):
    """A ``ValueError`` raised by the training loop, after set-up checked every input: not a
    usage error, so it ends in its traceback with exit status 1 (see cli/pretrain.py)."""


class Trainer:
    """One run: set up in the constructor (process groups, model, optimizer, checks of the
    checkpoint and data files, then the run directory, resume, data), then :meth:`train`.
    Nothing is written before every input has been checked."""

    def __init__(self, cfg, device: str, on_stall=None, lock: Optional[RunLock] = None,
                 callbacks: Sequence[TrainerCallback] = ()):
        self.cfg, self.device = cfg, device
        # training.device=auto is known only now; the RNG tracker's graph-safe seeding below
        # would otherwise fail first, with megatron's assertion
        check_cuda_graphs(cfg.training.cuda_graph_impl, cfg.training.recompute, device)
        self.callbacks = tuple(callbacks)  # train/callbacks.py; usually none
        self.lock = lock or RunLock()  # the caller releases it (train() does)
        self.t_start = time.perf_counter()
        self.train_iters = train_iterations(cfg)
        self.dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" \
            else torch.device("cpu")
        self.monitor = RankMonitor(process_group_timeout(cfg.parallel.timeout_minutes))
        # NCCL: a stalled collective raises nothing; the watch names the rank (resilience.py)
        self.stall_watch = StallWatch(
            self.monitor, process_group_timeout(cfg.parallel.timeout_minutes),
            stall_barrier_window(cfg.parallel.timeout_minutes),
            on_stall) if device == "cuda" and on_stall is not None else None
        self.skips = SkipBudget(cfg.training.max_skipped_steps)
        self._init_parallel()
        self.run_dir = Path(cfg.logging.run_dir)
        self.save_dir = cfg.checkpoint.save or str(self.run_dir / "checkpoints")
        self._phase("building the model and the optimizer")
        self._build_model()
        resume_from = self._check_inputs()
        self._prepare_run_dir()
        self.writer = CheckpointWriter(self.save_dir, cfg.checkpoint.async_save,
                                       cfg.checkpoint.keep_last, self.callbacks)
        self.state, self.last_saved = self._resume(*resume_from)
        self._phase("building the datasets")
        self._build_data()
        self.flops_per_token = flops_per_token(cfg, cfg.parallel.mode,
                                               vocab_size=self.padded_vocab)
        self.peak = peak_tflops(cfg.logging.peak_tflops, device)
        self.window = LogWindow()
        self.step_comm_bytes = self._step_comm_bytes()
        self.last_validation = None  # (iteration, val_loss, val_ppl)

    # ---- set-up ----------------------------------------------------------------------------

    def _phase(self, what: str) -> None:
        """One line (rank 0) as a phase before the first log line starts: each can take
        minutes (megatron's build, the datasets' index files, the first step's compilation)."""
        print0(f"setup {time.perf_counter() - self.t_start:.1f}s: {what}")

    def _init_parallel(self) -> None:
        t, par = self.cfg.training, self.cfg.parallel
        random.seed(t.seed)
        np.random.seed(t.seed)
        torch.manual_seed(t.seed)
        timeout = collective_timeout(par.timeout_minutes, self.device)
        self.dp = step.initialize_parallel(par.tp, par.pp, par.vpp, t.seed,
                                           timeout.total_seconds() / 60,
                                           cuda_graphs=t.cuda_graph_impl == "local")
        init_num_microbatches_calculator(dist.get_rank(), None, t.global_batch_size,
                                         t.micro_batch_size, self.dp)
        self.num_microbatches = get_num_microbatches()

    def _prepare_run_dir(self) -> None:
        """Rank 0 creates the run and save directories and takes their lock (train/run_lock.py:
        a second launch into them is refused here, on every rank, before it writes or deletes
        anything), then writes config.yaml."""
        refusal = None
        if dist.get_rank() == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            Path(self.save_dir).mkdir(parents=True, exist_ok=True)
            try:
                self.lock.acquire([self.run_dir, self.save_dir], say=print0)
                (self.run_dir / "config.yaml").write_text(resolved_config_yaml(self.run))
            except ValueError as err:
                refusal = str(err)
        agreed = [refusal]
        dist.broadcast_object_list(agreed, src=0)
        if agreed[0]:
            raise ValueError(agreed[0])

    def _resolved_config(self) -> dict:
        """The resolved run (``config.yaml``'s content) and this launch's layout, for
        experiment tracking."""
        return {**resolved_config(self.run),
                "resolved": {"padded_vocab_size": self.padded_vocab,
                             "train_iters": self.train_iters, "dp": self.dp,
                             "world_size": dist.get_world_size()}}

    def _build_model(self) -> None:
        """Resolve the run for this process (device, precision, attention, the tokenizer's
        padded vocabulary, process groups) and build it with the one builder."""
        cfg = self.cfg
        self.data_cfg = dataclasses.replace(cfg.data)
        if self.data_cfg.mock and not self.data_cfg.tokenizer_model:
            self.data_cfg.mock_vocab_size = cfg.model.vocab_size
        self.tokenizer = build_tokenizer(self.data_cfg)
        self.run = resolve_run(cfg, self.device, tokenizer=self.tokenizer)
        self.vocab, self.padded_vocab = self.run.vocab_size, self.run.padded_vocab_size
        built = build_run(self.run, get_batch=self._batch_on_device)
        self.model, self.optimizer, self.scheduler = built.chunks, built.optimizer, \
            built.scheduler
        self.forward_step = built.forward_step
        self._print_banner()
        if self.device == "cuda":  # the op ledger's kernels hold only where the fuser compiles
            from megatron_boost.measure.fusion_check import jit_fuser_problem, run_fuser_notice

            notice = run_fuser_notice(self.cfg, jit_fuser_problem())
            if notice:
                print0(notice)

    def _print_banner(self) -> None:
        cfg, par, t = self.cfg, self.cfg.parallel, self.cfg.training
        m, gbs, seq = cfg.model, t.global_batch_size, cfg.model.seq_length
        n_params = sum(p.numel() for c in self.model for p in c.module.parameters())
        attention, why = self.run.attention_backend, self.run.attention_reason
        print0(f"megatron-boost: mode={par.mode} tp={par.tp} pp={par.pp} vpp={par.vpp} "
               f"dp={self.dp} world={dist.get_world_size()} device={self.device} "
               f"(training.device={t.device}) precision={self.run.precision} "
               f"(training.precision={t.precision}) attention={attention} ({why}) "
               f"sequence_parallel={'on' if self.run.sequence_parallel else 'off'} "
               f"({self.run.sequence_parallel_reason}) | "
               f"fusions: {format_fusions(self.run.fusions)} | optimizer={cfg.optimizer.name} | layers={m.num_layers} "
               f"d={m.hidden_size} f={m.ffn_hidden_size} vocab={self.vocab} (padded {self.padded_vocab}) "
               f"seq={seq} | params on rank 0: {n_params / 1e6:.2f}M | "
               f"global batch {gbs} = micro {t.micro_batch_size} × dp {self.dp} × "
               f"{self.num_microbatches} micro-batches | {self.train_iters} iterations "
               f"({self.train_iters * gbs * seq:,} tokens)")

    def _check_inputs(self):
        """Check the dataset files and the checkpoint to resume from (if any) against this
        model, before anything is written. Returns (checkpoint dir, its saved state, whether
        only its weights are taken: checkpoint.init_from), or (None, None, False)."""
        validate_data_files(self.data_cfg, self.vocab)
        ck = self.cfg.checkpoint
        ckpt = find_checkpoint(ck.load or self.save_dir)
        if ck.load and ckpt is None:
            raise ValueError(f"checkpoint.load '{ck.load}' holds no checkpoint "
                             f"(no {TRACKER_FILE} and no metadata.json)")
        if ckpt is None and ck.init_from:  # a new run starting from given weights
            init = find_checkpoint(ck.init_from)
            if init is None:
                raise ValueError(f"checkpoint.init_from '{ck.init_from}' holds no checkpoint "
                                 f"(no {TRACKER_FILE} and no metadata.json)")
            return init, verify_checkpoint(init, self.model, self.cfg, weights_only=True), True
        if ckpt is None:
            return None, None, False
        return ckpt, verify_checkpoint(ckpt, self.model, self.cfg), False

    def _resume(self, ckpt, saved, weights_only: bool):
        """The training state and the last saved iteration: from the verified checkpoint
        ``ckpt``, if any, else a fresh start (with ``weights_only``: a fresh start from its
        weights, checkpoint.init_from)."""
        if ckpt is None:
            return TrainState(), None
        if weights_only:
            load_weights(ckpt, self.model, self.optimizer)
            print0(f"initialised from the weights of {ckpt} (checkpoint.init_from: {self.save_dir}"
                   f" has no checkpoint yet); iteration 0, fresh optimizer state and schedule")
            return TrainState(), None
        t0 = time.perf_counter()
        resumed = load_checkpoint(ckpt, saved, self.model, self.optimizer, self.scheduler,
                                  self.cfg)
        s, lay = resumed.state, resumed.saved_layout
        print0(f"resumed from {ckpt} at iteration {s.iteration} ({s.consumed_samples} samples "
               f"consumed; saved layout tp={lay.get('tp')} pp={lay.get('pp')} "
               f"vpp={lay.get('vpp')} dp={lay.get('dp')}; optimizer state "
               f"{'not ' if self.cfg.checkpoint.no_load_optim else ''}loaded; rng "
               f"{'restored' if resumed.rng_restored else 'reseeded (layout changed)'}"
               f") in {time.perf_counter() - t0:.1f}s")
        return s, s.iteration

    def _build_data(self) -> None:
        t, seq = self.cfg.training, self.cfg.model.seq_length
        self.eval_iters = t.eval_iters or 0
        self.train_ds, self.valid_ds, _ = build_gpt_datasets(
            self.data_cfg, self.tokenizer, seq, t.seed,
            train_samples=self.train_iters * t.global_batch_size,
            valid_samples=max(self.eval_iters, 1) * t.global_batch_size, test_samples=None)
        if self.valid_ds is None or len(self.valid_ds) == 0:
            self.eval_iters = 0
        self.train_forward_step = self.forward_step  # a callback may wrap it (on_train_start)
        self.train_iterators = self._iterators(self.train_ds, self.state.consumed_samples, None,
                                               self.data_cfg.num_workers)
        self.metrics = MetricsWriter(self.run_dir, self.cfg.logging.tensorboard,
                                     self.state.iteration,
                                     wandb=(self.cfg.logging.wandb, self._resolved_config()))

    def _iterators(self, dataset, start: int, stop: Optional[int], num_workers: int) -> list:
        # Each virtual pipeline chunk draws the same micro-batches from its own iterator.
        return [make_data_iterator(dataset, start, self.cfg.training.micro_batch_size, stop,
                                   num_workers) for _ in self.model]

    def _batch_on_device(self, data_iterator) -> dict:
        batch = get_batch(data_iterator)
        return {k: v.to(self.dev, non_blocking=True) for k, v in batch.items()}

    # ---- the loop --------------------------------------------------------------------------

    def train(self) -> int:
        """Train until ``train_iters``; returns the exit status."""
        start = self.state.iteration
        self.progress = Progress(time.perf_counter(), start,
                                 self.state.consumed_samples * self.cfg.model.seq_length,
                                 self.train_iters, self.cfg.training.train_tokens)
        if start >= self.train_iters:
            print0(f"nothing to do: the checkpoint is at iteration {start} >= "
                   f"{self.train_iters} training iterations")
        for callback in self.callbacks:
            callback.on_train_start(self)
        if self.stall_watch is not None:
            self.stall_watch.start()
        try:
            if start < self.train_iters:
                self._phase(f"first training step (iteration {start + 1}: the slowest)")
            while self.state.iteration < self.train_iters:
                if self.iteration():
                    return PREEMPT_EXIT_CODE
            if self.state.iteration > start and self.last_saved != self.state.iteration:
                self.save()
            self.writer.close()
        except RuntimeError as err:
            if is_collective_failure(err):  # a rank died or hangs: say which, within the timeout
                raise self.monitor.explain(err, self.state.iteration + 1) from None
            raise
        finally:
            if self.stall_watch is not None:
                self.stall_watch.stop()
            self.metrics.close()
        self.print_summary()
        return 0

    def iteration(self) -> bool:
        """One iteration of the loop: train step, training log, checkpoint and exit decision.
        Returns True when the loop must stop early (pre-emption signal, exit interval or time
        limit)."""
        out = self.train_step()
        self.training_log(out)
        self.skips.record(out["skipped"], self.state.iteration)
        return self.checkpoint_and_decide_exit(out)

    def train_step(self) -> dict:
        """One optimizer step; returns loss, grad_norm, skipped, preempt, lr and
        tp_comm_bytes (the formula's bytes of the step; ``tp_comm_bytes_measured`` too where
        ``logging.measure_comm`` measured it).

        Nothing here waits for the device but the step's one agreement read and the
        optimizer's gradient norm (``train/step.py``), except at log iterations, which
        synchronise so that the log window's time is complete. A non-log step's remaining
        device work is waited for, and timed, by the next step's reads."""
        t, it = self.cfg.training, self.state.iteration + 1
        self.writer.poll()  # commit a finished background save
        for callback in self.callbacks:
            callback.on_step_start(self, it)
        self.scheduler.step(1)  # iteration k runs at scheduler step k
        lr = float(self.optimizer.param_groups[0]["lr"])
        logged = self._logs_at(it)
        measure = logged and self.cfg.logging.measure_comm
        t0 = time.perf_counter()
        with self._stall_watched(it), self._comm_measurement(measure) as comm_log:
            out = step.train_step(self.train_forward_step, self.train_iterators, self.model,
                                  self.optimizer, self.num_microbatches,
                                  self.cfg.model.seq_length, t.micro_batch_size,
                                  preempt_requested=preemption_requested(),
                                  time_up=self._past_exit_duration())
        if logged:
            self._synchronize()
        self.window.add(out["loss"], time.perf_counter() - t0,
                        t.global_batch_size * self.cfg.model.seq_length, out["skipped"])
        self.state.advance(t.global_batch_size)
        if out["skipped"]:
            print0(f"iteration {it}: loss or gradients not finite on some rank; step skipped "
                   f"(parameters and optimizer state unchanged; {self.skips.consecutive + 1} "
                   f"consecutive, training.max_skipped_steps={self.skips.limit})")
        out.update(lr=lr, tp_comm_bytes=self.step_comm_bytes)
        if measure:
            out["tp_comm_bytes_measured"] = comm_log.bytes()
        return out

    def _stall_watched(self, iteration: int):
        """The step's span for the stall watch (NCCL), or nothing."""
        if self.stall_watch is None:
            return contextlib.nullcontext()
        return self.stall_watch.step(iteration)

    def _comm_measurement(self, measure: bool):
        """``record_collectives`` on the TP group where ``measure``, else nothing: its
        process-wide wrappers (docs/design.md §5) never run during an ordinary step."""
        if not measure:
            return contextlib.nullcontext()
        from megatron_boost.measure.collectives import record_collectives

        return record_collectives(ps.get_tensor_model_parallel_group())

    def _step_comm_bytes(self) -> int:
        """Bytes this rank hands to TP collectives per training step, from the formula
        (``analysis/comm.py``, docs/design.md §5)."""
        chunks = [c.module for c in self.model]  # each a model, or its Float16Module

        def has(stage_end: str) -> bool:  # "pre_process" or "post_process"
            return any(get_attr_wrapped_model(c, stage_end) for c in chunks)

        layers = sum(len(get_attr_wrapped_model(c, "decoder").layers) for c in chunks)
        dtype = self.run.precision  # "fp32" or "bf16"
        comm = step_comm_bytes(
            ModelShape.from_config(self.cfg), self.cfg.parallel.mode, dtype,
            StepCommShape(tp=self.cfg.parallel.tp,
                          tokens_per_microbatch=(self.cfg.training.micro_batch_size
                                                 * self.cfg.model.seq_length),
                          num_microbatches=self.num_microbatches, local_layers=layers,
                          has_embedding=has("pre_process"), has_head=has("post_process"),
                          full_recompute=self.cfg.training.recompute == "full",
                          sequence_parallel=self.run.sequence_parallel))
        return comm["fwd"] + comm["bwd"]

    def _elapsed_minutes(self) -> float:
        return (time.perf_counter() - self.t_start) / 60.0

    def _past_exit_duration(self) -> bool:
        """Whether this rank's clock has passed ``training.exit_duration_minutes`` (the ranks
        agree on it in the step's all-reduce)."""
        limit = self.cfg.training.exit_duration_minutes
        return limit is not None and self._elapsed_minutes() > limit

    def _synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _logs_at(self, it: int) -> bool:
        """Whether iteration ``it`` writes a training log record (log or evaluation)."""
        return any(self._log_and_eval_at(it))

    def _log_and_eval_at(self, it: int):
        """(log, evaluate) at iteration ``it``."""
        last = it == self.train_iters
        eval_interval = self.cfg.training.eval_interval
        do_log = it % self.cfg.logging.log_interval == 0 or last
        do_eval = self.eval_iters > 0 and bool(
            (eval_interval and it % eval_interval == 0) or last)
        return do_log, do_eval

    def training_log(self, out: dict) -> None:
        """At log and evaluation iterations: one console line and one metrics record over
        the window since the last one (evaluation adds a validation line)."""
        do_log, do_eval = self._log_and_eval_at(self.state.iteration)
        if not (do_log or do_eval):
            return
        record = self._metrics_record(out)
        line = format_log_line(record, self.train_iters)
        if do_eval:
            line += "\n" + self.evaluate_and_record(record)
        print0(line)
        self.metrics.write(record)
        self.window.reset()

    def _metrics_record(self, out: dict) -> dict:
        tokens_per_s = self.window.tokens_per_s()
        tflops = self.flops_per_token * tokens_per_s / dist.get_world_size() / 1e12
        return {
            "iteration": self.state.iteration,
            "tokens": self.state.consumed_samples * self.cfg.model.seq_length,
            "loss": self.window.mean_loss(),  # every rank has it (train/step.py)
            "lr": out["lr"], "grad_norm": out["grad_norm"], "tokens_per_s": tokens_per_s,
            "tflops": tflops, "mfu": (tflops / self.peak) if self.peak else None,
            "tp_comm_bytes": out["tp_comm_bytes"],
            **({"tp_comm_bytes_measured": out["tp_comm_bytes_measured"]}
               if "tp_comm_bytes_measured" in out else {}),
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "step_time_s": self.window.step_time_s(),
            "skipped_steps": self.window.skipped,
            **self._progress_fields(),
        }

    def _progress_fields(self) -> dict:
        now, tokens = time.perf_counter(), self.state.consumed_samples * self.cfg.model.seq_length
        return {"elapsed_s": self.progress.elapsed_s(now),
                "eta_s": self.progress.eta_s(now, self.state.iteration, tokens)}

    def evaluate_and_record(self, record: dict) -> str:
        """Validation loss and perplexity into ``record``; returns the console line."""
        t0 = time.perf_counter()
        record["val_loss"] = self.evaluate()
        record["val_ppl"] = validation_perplexity(record["val_loss"])
        self.last_validation = (record["iteration"], record["val_loss"], record["val_ppl"])
        return format_validation_line(record, time.perf_counter() - t0)

    def evaluate(self) -> Optional[float]:
        """Mean loss over ``eval_iters`` global batches from the start of the validation split."""
        t, seq = self.cfg.training, self.cfg.model.seq_length
        iterators = self._iterators(self.valid_ds, 0, self.eval_iters * t.global_batch_size, 0)
        losses = [step.eval_step(self.forward_step, iterators, self.model,
                                 self.num_microbatches, seq, t.micro_batch_size)
                  for _ in range(self.eval_iters)]
        return sum(losses) / len(losses)  # each is on every rank (train/step.py)

    def checkpoint_and_decide_exit(self, out: dict) -> bool:
        """Save at the save interval; on a reason to stop early that every rank agreed on in
        this step (a pre-emption signal, the time limit: both in ``out``; the exit interval:
        the iteration itself) save (once) and ask the loop to stop."""
        it, interval = self.state.iteration, self.cfg.checkpoint.save_interval
        if interval and it % interval == 0:
            self.save()
        reason = self._early_exit_reason(out)
        if it >= self.train_iters or reason is None:
            return False
        if self.last_saved != it:
            self.save()
        self.writer.close()  # the checkpoint is committed before the process exits
        what, why = reason
        print0(f"{what}, checkpoint saved at iteration {it} "
               f"({why}; exiting with status {PREEMPT_EXIT_CODE})")
        return True

    def _early_exit_reason(self, out: dict) -> Optional[tuple]:
        """(what, why) the loop stops after this iteration before its budget, or None."""
        t, it = self.cfg.training, self.state.iteration
        if out["preempt"]:
            return "pre-emption signal received", signal_name()
        if out["time_up"]:
            return ("time limit reached", f"{self._elapsed_minutes():.2f} minutes since the "
                    f"launch > training.exit_duration_minutes={t.exit_duration_minutes:g}")
        if t.exit_interval and it % t.exit_interval == 0:
            return "exit interval reached", f"training.exit_interval={t.exit_interval}"
        return None

    def save(self) -> None:
        """Save this iteration (in the background with ``checkpoint.async_save``); logs how
        long training was stalled by it."""
        t0 = time.perf_counter()
        sd = checkpoint_state_dict(self.state, self.model, self.optimizer, self.scheduler,
                                   self.cfg)
        self.writer.save(sd, self.state.iteration)
        self.last_saved = self.state.iteration
        how = "started saving" if self.cfg.checkpoint.async_save else "saved"
        print0(f"{how} checkpoint {self.save_dir}/{iter_dir_name(self.state.iteration)} "
               f"(training stalled {time.perf_counter() - t0:.3f}s)")

    def print_summary(self) -> None:
        s, now = self.state, time.perf_counter()
        line = self.progress.done_line(now, now - self.t_start, s.iteration,
                                       s.consumed_samples * self.cfg.model.seq_length)
        if self.last_validation is not None:
            it, val_loss, val_ppl = self.last_validation
            line += (f" | final validation (iteration {it}): val_loss {val_loss:.4f}, "
                     f"val_ppl {val_ppl:.2f}")
        print0(line)
