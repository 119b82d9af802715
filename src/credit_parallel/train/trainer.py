"""The parallel trainer (CREDIT's gen2 loop): one code path for 1 process or N ranks.

Data: each rank's DataLoader (:func:`~credit_parallel.data.loader.build_train_loader`) reads only
its domain rows (on a lat x lon domain: its tile, rows x columns) of its dp share, in worker processes; the trainer moves each batch to its
device and registers the global shape with the domain manager (``register_row_batch``, what
``shard_batch`` does for a whole-globe batch).  A single process reads rows ``(0, H)`` through the
same path, so the float32 normalisation is the same on every layout.

Per optimizer step: ``grad_accum`` micro-batches from the never-ending loader (gradient sync
suppressed until the last) -> autoregressive rollout of ``forecast_len`` steps that stays
sharded -> latitude-weighted MSE share (exact on uneven shards) -> backward.  Then
domain-gradient sync (sum of shares) and global-norm clipping — all of that is
:class:`~credit_parallel.train.step.TrainStep` — then one non-finite check (the global gradient
norm, which every rank computes identically), AdamW and the LR schedule.

Data order is a pure function of the micro-batch number ``step * grad_accum + micro`` (epoch
after epoch, the DP sampler seeded per epoch), so a resumed run restarts the loader at its step
and continues the exact trajectory of an uninterrupted one.  The model is built on the meta
device and materialised already sharded (:func:`~credit_parallel.train.model_init.build_parallel_model`).
The model, the batches and the loss weights live on :func:`device_for_process_group`'s device
(``cuda:LOCAL_RANK`` under NCCL, the CPU under gloo) unless a ``device`` is injected.
"""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.loader import build_train_loader, global_width, register_row_batch
from ..data.prefetch import DevicePrefetcher
from ..domain.guard import FunctionalCallGuard, guard_requested
from ..forecast.metrics import spatial_acc, spatial_mse
from ..forecast.scores import climatology, flatten_channels
from ..forecast.units import ForecastUnits
from ..layout.config import ENSEMBLE, DataMode, has_process_group
from ..layout.credit_gen2 import credit_gen2_conf
from ..layout.device import autocast_for, batch_to_device, device_for_process_group
from ..models import build_model
from ..parallel.composition import (
    RecipeOptions,
    get_device_mesh,
    get_domain_manager,
    parallelize_dims,
)
from ..parallel.fsdp import fsdp2_layout_note
from .async_save import AsyncCheckpointer, staging_bytes_estimate
from .checkpoint import (
    CheckpointError,
    checkpoint_state,
    config_hash,
    list_checkpoints,
    load_checkpoint,
    write_checkpoint,
)
from .credit_loss import TOP as LOSS_TOP
from .credit_loss import credit_base_loss, loss_state, restore_loss_state
from .credit_resume import load_credit_resume, restore_credit_ema
from .crps import crps_weighted_loss
from .ema import TOP as EMA_TOP
from .ema import (
    build_ema,
    ema_checkpoint_state,
    ema_template,
    ema_weights,
    has_ema,
    has_top_level,
    restore_ema,
)
from .ensemble_conf import crps_loss
from .model_init import build_parallel_model
from .preflight import check_run
from .schedule import TOP as SCHEDULE_TOP
from .schedule import build_scheduler, schedule_state, step_scheduler
from .step import (
    TrainStep,
    advance_state,
    batch_keys,
    forcing_at,
    latitude_weighted_loss,
    replica_mean_loss,
)

__all__ = ["NonFiniteError", "Trainer"]


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient under the ``stop`` policy."""


def _world_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


class Trainer:
    """Builds model, data and optimizer from a config and trains under its parallel layout.

    ``device``: where the model, batches and loss weights live (default: the process group's
    device, :func:`~credit_parallel.layout.device.device_for_process_group`).
    """

    def __init__(self, conf: dict, *, dataset=None, val_dataset=None, model=None, device=None):
        self.world = dist.get_world_size() if has_process_group() else 1
        self.rank = dist.get_rank() if has_process_group() else 0
        # every problem of the run (trainer keys, layout, model, data) at once, before anything;
        # the run config and the layout come back parsed, once, and are used from here on; a
        # CREDIT gen-2 config is read as credit-parallel's keys first (layout/credit_gen2.py)
        conf = credit_gen2_conf(conf)
        self.run_config, self.dims = check_run(conf, self.world, dataset, model=model)
        self.conf = conf
        self.block = dict(self.run_config.parallelism)
        self.tc = self.run_config.trainer
        self.dtype = torch.float64 if self.tc.dtype == "float64" else torch.float32
        self.device = torch.device(device) if device is not None else device_for_process_group()
        # the SPEC layout's coordinates, known before the model (and its manager) exists
        coords = self.dims.coords(self.rank)
        self.dp_rank, self.dp_size = coords["dp"], self.dims.dp
        self.domain_rank, self.domain_size = coords["domain"], self.dims.domain
        # what the loader splits: latitude rows, or (P, Q) tiles of rows x columns (SPEC §3b)
        self.domain_split = self.dims.domain_shape if self.dims.is_2d else self.dims.domain
        self._train_source, self._val_source = dataset, val_dataset
        self.step = 0
        self.checkpointer: AsyncCheckpointer | None = None  # the first async save creates it
        self._start_loader()
        self.dataset = self.loader.dataset  # this rank's rows (a RowView of a dataset passed in)
        self.model = self._build_model(model)
        self.manager = get_domain_manager(self.model)
        self._check_rows_match_manager()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.tc.lr, weight_decay=self.tc.weight_decay
        )
        # trainer.credit_resume: a CREDIT checkpoint directory's weights (optimizer, scheduler)
        self._credit_resumed = load_credit_resume(self.model, self.optimizer, self.tc)
        self.scheduler = build_scheduler(self.optimizer, self.tc, resumed=self._credit_resumed)
        # trainer.use_ema: miles-credit's EMATracker, updated after every optimizer step
        self.ema = build_ema(self.model, self.tc.ema_decay) if self.tc.use_ema else None
        restore_credit_ema(self.ema, self.model, self.tc)
        self.history: list[dict] = []
        # this rank's rows of the validation climatology (normalised units): evaluate's ACC
        self.climatology: torch.Tensor | None = None
        self.lat_weights = self.dataset.lat_weights.to(device=self.device, dtype=self.dtype)
        self.global_height = int(self.lat_weights.shape[0])
        # the global W: the loss share of a tile is normalised by it (None: rows hold every column)
        self.global_width = global_width(self.dataset) if self.dims.is_2d else None
        self._lat_local = self.dataset.row_lat_weights.to(device=self.device, dtype=self.dtype)
        self.step_fn = TrainStep(
            self.model,
            latitude_weighted_loss(self._lat_local, self.global_height, self.global_width),
            manager=self.manager,
            forecast_len=int(getattr(self.dataset, "forecast_len", 1) or 1),
            max_norm=self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf"),
            autocast=self._autocast,
            guard=partial(FunctionalCallGuard, raise_on_finding=True)
            if guard_requested(self.tc.domain_guard)
            else None,
            shard_inputs=False,  # the loader reads this rank's rows already
            n_forcing=int(getattr(self.dataset, "n_forcing", 0) or 0),
            n_static=int(getattr(self.dataset, "n_static", 0) or 0),
            n_diagnostic=int(getattr(self.dataset, "n_diagnostic", 0) or 0),
        )
        self._set_credit_loss()
        self._set_ensemble_loss()

    def _set_ensemble_loss(self) -> None:
        """``trainer.ensemble_size`` K with a CRPS loss (train/crps.py): this rank runs K/E
        members of each sample, the loss is its CRPS share (the members of the other ensemble
        ranks come round the "ensemble" mesh axis)."""
        loss = crps_loss(self.conf, self.tc.ensemble_size)
        if loss is None:
            return
        group = None
        if self.dims.ensemble > 1:
            group = get_device_mesh(self.model)[ENSEMBLE].get_group()
        self.step_fn.members = loss.members // self.dims.ensemble
        if self.credit_loss is not None:  # ring-crps inside CREDIT's loss.type: base
            self.credit_loss.ensemble = (loss, group)
            return
        self.step_fn.loss_fn = crps_weighted_loss(
            loss, self._lat_local, self.global_height, self.global_width, group
        )

    def _set_credit_loss(self) -> None:
        """``loss.type: base`` (CREDIT's per-variable loss, train/credit_loss.py) as the step's
        loss; its learnable weights (if any) with their own AdamW on the model's schedule."""
        rows = slice(*(getattr(self.dataset, "rows", None) or (0, self.global_height)))
        build = partial(
            credit_base_loss,
            self.conf,
            self.dataset,
            lambda w: w[rows].to(device=self.device, dtype=self.dtype),
            self.global_width,
            self.domain_size,
        )
        self.credit_loss = build()
        self.credit_valid_loss = build(validation=True) if self.credit_loss else None
        self.loss_optimizer = self.loss_scheduler = None
        if self.credit_loss is None:
            return
        self.step_fn.loss_fn = self.credit_loss
        learnable = self.credit_loss.learnable
        if learnable is None:
            return
        learnable.to(device=self.device, dtype=self.dtype)
        self.credit_valid_loss.learnable = learnable
        self.loss_optimizer = torch.optim.AdamW(
            learnable.parameters(), lr=self.tc.lr, weight_decay=self.tc.weight_decay
        )
        # the model's schedule (CREDIT: one optimizer, the weights an extra param group)
        self.loss_scheduler = build_scheduler(self.loss_optimizer, self.tc)

    @property
    def layout_notes(self) -> list[str]:
        """What the run's first lines say about the layout beyond the config: FSDP2 not applied
        at a one-rank shard group (SPEC §4)."""
        note = None
        if self.dims.fsdp_group_size:
            note = fsdp2_layout_note(
                self.dims.fsdp_group_size, self.tc.fsdp2_single_rank, self.tc.amp
            )
        return [note] if note else []

    def _build_model(self, model):
        """The parallel model with identical initial weights on every rank.

        From ``conf["model"]`` the model never exists whole: ``build_parallel_model`` builds it
        on the meta device and materialises this rank's shards on ``self.device`` with the
        values of ``torch.manual_seed(seed); build_model(...).to(dtype)`` in one process.  A
        model instance passed in is moved to the device and parallelised as it is.
        """
        options = RecipeOptions.from_trainer(self.tc)
        if model is None:
            model_conf, dtype = self.conf["model"], self.dtype
            return build_parallel_model(
                lambda: build_model(model_conf).to(dtype),
                device=self.device,
                seed=self.tc.seed,
                dims=self.dims,
                options=options,
            )
        torch.manual_seed(self.tc.seed)
        model = model.to(device=self.device, dtype=self.dtype)
        return parallelize_dims(model, self.dims, options)

    # ------------------------------------------------------------------ data
    def _loader_for(self, split: str, start_step: int = 0):
        """This rank's DataLoader of ``split``.  A dataset passed to the trainer is read in this
        process (``num_workers=0``): it may hold state (read counts, the trainer) that a worker's
        copy would not share.  Validation reads ``val_dataset``, else the config's
        ``data.valid_time_slice``, else the training data (with validation's own seed stream)."""
        conf, source = self.conf, self._train_source
        if split == "valid":
            if self._val_source is not None:
                source = self._val_source
            elif source is None and self.run_config.data.valid_time_slice is None:
                data = dict(conf["data"], valid_time_slice=conf["data"].get("time_slice"))
                conf = {**conf, "data": data}
        return build_train_loader(
            conf,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            domain_rank=self.domain_rank,
            domain_size=self.domain_split,
            device=self.device,
            start_step=start_step,
            split=split,
            num_workers=0 if source is not None else None,
            dataset=source,
        )

    def _start_loader(self) -> None:
        """(Re)start the training stream at micro-batch ``step * grad_accum`` (after a resume)."""
        if getattr(self, "_batches", None) is not None:
            self._batches.close()  # the old stream's workers stop now, not at garbage collection
        self.loader = self._loader_for("train", self.step)
        # the next data.device_prefetch batches are copied to the device while a step computes
        self._batches = DevicePrefetcher(
            self.loader, self.device, self.dtype, self.run_config.data.device_prefetch
        )

    def close(self) -> None:
        """Stop the training loader's worker processes (also done when the trainer is collected;
        the run's end calls it so that no worker outlives the loop)."""
        self._batches.close()

    def _device_batch(self, host: dict) -> dict:
        """A host batch of this rank's rows on the trainer's device and dtype, its global shape
        registered with the manager (what ``shard_batch`` did for a whole-globe batch)."""
        batch = batch_to_device(host, self.device, self.dtype)
        self._register(batch)
        return batch

    def _register(self, batch: dict) -> None:
        register_row_batch(
            batch, self.global_height, manager=self.manager, global_width=self.global_width
        )

    def _micro_batches(self):
        for _ in range(self.tc.grad_accum):
            batch = next(self._batches)  # already on the device, in the trainer's dtype
            self._register(batch)
            yield batch

    def _check_rows_match_manager(self) -> None:
        if self.manager is not None and self.manager.domain_rank != self.domain_rank:
            raise RuntimeError(
                f"rank {self.rank}: the loader reads the rows of domain rank {self.domain_rank} "
                f"but the model's manager is domain rank {self.manager.domain_rank}"
            )

    def _autocast(self):
        # FSDP2 applies its own bf16 policy, and where its group has one rank the model computes
        # under its own autocast (parallel/precision.py); autocast here only for the others
        return autocast_for(self.device, self.tc.amp and self.dims.data != DataMode.FSDP2)

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        started, waited = time.perf_counter(), self._batches.wait_s
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.loss_optimizer is not None:
            self.loss_optimizer.zero_grad(set_to_none=True)
        result = self.step_fn(self._micro_batches(), grad_accum=self.tc.grad_accum)
        if self.loss_optimizer is not None:
            self.credit_loss.learnable.reduce_grad(self.dims.tp, self.dims.dp)
        loss = replica_mean_loss(result.loss_share, tp_size=self.dims.tp, dp_size=self.dims.dp)
        grad_norm = result.grad_norm
        finite = bool(torch.isfinite(grad_norm).item()) and bool(torch.isfinite(loss).item())
        record = {
            "step": self.step + 1,
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        # host time blocked on the loader this step (the finite check above synchronised)
        wait = self._batches.wait_s - waited
        record["data_wait_ms"] = wait * 1e3
        record["data_wait_frac"] = wait / max(time.perf_counter() - started, 1e-9)
        if not finite:
            record["nonfinite"] = True
            if self.tc.nonfinite == "stop":
                raise NonFiniteError(
                    f"non-finite loss/gradient at step {self.step + 1} (loss {float(loss)}, grad norm "
                    f"{float(grad_norm)}); trainer.nonfinite is 'stop' (set 'skip' to skip such steps)"
                )
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            if self.loss_optimizer is not None:
                self.loss_optimizer.step()
            if self.ema is not None:
                self.ema.update(self.model)
        step_scheduler(self.scheduler, float(loss))  # CREDIT's plateau steps on the loss
        step_scheduler(self.loss_scheduler, float(loss))
        self.step += 1
        self.history.append(record)
        return record

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        """Scores of every forecast step of ``forecast_len`` over ``val_batches`` validation
        batches, per output channel (per variable and level for 5-D models), exact under any
        layout (:mod:`credit_parallel.forecast.metrics`: global sums over the domain rows, the
        mean over the batches of every dp rank).

        Keys: ``rmse/<channel>`` (step 1) and ``rmse@t+<k>/<channel>`` (step k >= 2): the
        latitude-weighted RMSE in the data's (normalised) units; with a ``climatology`` set
        (:meth:`use_training_climatology`), ``acc/<channel>`` and ``acc@t+<k>/<channel>`` too.
        Under ``trainer.use_ema`` on the EMA weights (as CREDIT validates), the training
        weights restored exactly afterwards.
        """
        with ema_weights(self.ema, self.model):
            return self._evaluate()

    @torch.no_grad()
    def _evaluate(self) -> dict:
        loader = self._loader_for("valid")
        batches = iter(loader)
        self.model.eval()
        steps = int(getattr(self.dataset, "forecast_len", 1) or 1)
        sums = count = None
        self._valid_loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for _ in range(self.tc.val_batches):
            batch = self._device_batch(next(batches))
            part = self._score_rollout(batch, steps)  # (steps, 2, C) sums over the batch
            sums = part if sums is None else sums + part
            count = batch[batch_keys(batch)[0][0]].shape[0] + (0 if count is None else count)
        self.model.train()
        total = torch.cat([sums.flatten(), sums.new_tensor([float(count)])])
        total = self._sum_over_replicas(total)
        means = total[:-1].view(sums.shape) / total[-1]
        ds = loader.dataset  # the output channels: prognostic then diagnostic
        names = getattr(ds, "output_variable_names", None) or getattr(ds, "variable_names", None)
        names = names or [f"ch{i}" for i in range(means.shape[-1])]
        metrics = {}
        for k in range(steps):
            suffix = "" if k == 0 else f"@t+{k + 1}"
            metrics.update(
                {f"rmse{suffix}/{n}": math.sqrt(float(v)) for n, v in zip(names, means[k, 0])}
            )
            if self.climatology is not None:
                metrics.update({f"acc{suffix}/{n}": float(v) for n, v in zip(names, means[k, 1])})
        if self.credit_valid_loss is not None:  # CREDIT's valid loss (validation_loss if given)
            summed = (
                _world_sum(self._valid_loss_sum) / self.dims.tp
                if has_process_group()
                else self._valid_loss_sum
            )
            metrics["loss"] = float(summed) / float(total[-1])
        return metrics

    def _score_rollout(self, batch: dict, steps: int) -> torch.Tensor:
        """Roll the model out over ``steps`` from one (row-sharded) batch; per step the sums
        over the batch of the spatial MSE and ACC per channel (float64, ``(steps, 2, C)``)."""
        in_keys, out_keys = batch_keys(batch)
        state = tuple(batch[k] for k in in_keys)
        rows = []
        for k in range(steps):
            outs = self.model(*state)
            outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
            targets = tuple(
                batch[key][:, k * o.shape[1] : (k + 1) * o.shape[1]]
                for key, o in zip(out_keys, outs)
            )
            if self.credit_valid_loss is not None:  # the share of the batch's mean, x batch
                share = self.credit_valid_loss(outs, targets).double()
                self._valid_loss_sum += share * outs[0].shape[0] / steps
            pred, truth = flatten_channels(outs), flatten_channels(targets)
            mse = spatial_mse(pred, truth, self._lat_local, manager=self.manager)
            acc = torch.zeros_like(mse)
            if self.climatology is not None:
                clim = self.climatology.to(self.device)
                acc = spatial_acc(pred, truth, clim, self._lat_local, manager=self.manager)
            rows.append(torch.stack([mse.sum(dim=0), acc.sum(dim=0)]))
            if k + 1 < steps:
                forcing = forcing_at(batch.get("forcing"), k + 1, self.step_fn.n_forcing)
                state = advance_state(
                    state,
                    outs,
                    forcing,
                    n_forcing=self.step_fn.n_forcing,
                    n_static=self.step_fn.n_static,
                    n_diagnostic=self.step_fn.n_diagnostic,
                )
        return torch.stack(rows)

    def _sum_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the same on every domain and tp rank of a dp replica) summed over the dp
        replicas: over the manager's data-parallel group, else over the world counted once per
        tp rank."""
        if not has_process_group():
            return t
        if self.manager is not None:
            dist.all_reduce(t, group=self.manager.data_parallel_group)
            return t
        return _world_sum(t) / self.dims.tp

    def use_training_climatology(self, path=None) -> torch.Tensor:
        """Set ``climatology`` (what ``evaluate``'s ACC is against): the time mean of the
        training range at each grid point of this rank's rows, read by rows from the store
        (:func:`credit_parallel.forecast.scores.climatology`; ``path``: a climatology file
        instead), in the model's units: the run's own normalisation (mean / std, or CREDIT's
        preblock chain as on a target: ``forecast/units.py``).  Reads the whole training range
        once."""
        raw = climatology(self.conf, domain_shard=(self.domain_rank, self.domain_split), path=path)
        units = ForecastUnits(self.dataset, "cpu")
        clim = units.climatology_in_model_units(raw)
        self.climatology = clim.to(device=self.device, dtype=torch.float64)
        return self.climatology

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory, *, wait: bool = True) -> Path:
        """Checkpoint this step into ``directory`` (every rank calls it); the path it has once
        complete.  Under ``trainer.checkpoint_async`` the state is staged into reused host
        buffers and written by a writer thread (``train/async_save.py``): with ``wait=False``
        this returns as soon as the state is staged (a save still in flight is waited for
        first).  Raises :class:`~credit_parallel.train.checkpoint.CheckpointSaveError` for a
        failed write (of this save, or of the previous one)."""
        directory = Path(directory)
        write = partial(
            write_checkpoint,
            directory=directory,
            step=self.step,
            manifest={
                "layout": self.block,
                "world_size": self.world,
                "config_hash": config_hash(self.conf),
                "ema": self.ema is not None,
            },
            has_optimizer=True,
            keep=self.tc.checkpoint_keep,
        )
        state = partial(checkpoint_state, self.model, self.optimizer, self._extra_state())
        if not self.tc.checkpoint_async:
            return write(state())
        if self.checkpointer is None:
            self.checkpointer = AsyncCheckpointer(
                self.device, dist_timeout_s=self.tc.dist_timeout_s
            )
        self.checkpointer.save(lambda staged, group: write(staged, group=group), state)
        if wait:
            self.checkpointer.wait()
        return directory / f"step_{self.step:08d}"

    def wait_for_save(self) -> None:
        """Wait for the save in flight (raising its error); the writer thread stops."""
        if self.checkpointer is not None:
            try:
                self.checkpointer.wait()
            finally:
                self.checkpointer.close()

    @property
    def staging_bytes(self) -> int:
        """Host bytes an async save stages on this rank (the buffers' size once allocated,
        else the estimate from the parameters: model, AdamW moments, EMA shadow)."""
        if self.checkpointer is not None and self.checkpointer.stager.buffers:
            return self.checkpointer.stager.nbytes
        return staging_bytes_estimate(self.model, ema=self.ema is not None)

    def _extra_state(self, template: bool = False) -> dict | None:
        """What the checkpoint holds beside the model and the optimizer: the EMA shadow, the
        learnable loss weights (``credit_loss``); ``template``: what a load fills in place."""
        extra = {}
        if self.ema is not None:
            make = ema_template if template else ema_checkpoint_state
            extra.update(make(self.ema, self.model))
        if self.loss_optimizer is not None:
            extra.update(loss_state(self.credit_loss.learnable, self.loss_optimizer, template))
        extra.update(schedule_state(self.scheduler, template))  # CREDIT's plateau state
        return extra or None

    def load(self, path) -> dict:
        """Model, optimizer, step (and the EMA shadow: from the checkpoint when it holds one,
        else started afresh at the loaded weights); the data stream continues at the step."""
        extra = {}
        if self.ema is not None and has_ema(path):
            extra.update(ema_template(self.ema, self.model))
        learnable = self.loss_optimizer is not None and has_top_level(path, LOSS_TOP)
        if learnable:
            extra.update(loss_state(self.credit_loss.learnable, self.loss_optimizer, True))
        if has_top_level(path, SCHEDULE_TOP):
            extra.update(schedule_state(self.scheduler, True))
        manifest = load_checkpoint(path, self.model, self.optimizer, extra=extra or None)
        if EMA_TOP in extra:
            restore_ema(self.ema, extra)
        elif self.ema is not None:
            self.ema = build_ema(self.model, self.tc.ema_decay)
        if learnable:
            restore_loss_state(self.credit_loss.learnable, self.loss_optimizer, extra)
        self.step = int(manifest["step"])
        state = extra.get(SCHEDULE_TOP, {}).get("state")
        self.scheduler = build_scheduler(
            self.optimizer, self.tc, step=self.step, resumed=self._credit_resumed, state=state
        )
        if self.loss_optimizer is not None:  # the same schedule, at the same step
            self.loss_scheduler = build_scheduler(
                self.loss_optimizer, self.tc, step=self.step, state=state
            )
        self._start_loader()  # the data stream continues at the loaded step
        return manifest

    def resume_latest(self, directory, *, fallback: bool = True, on_skip=None) -> dict | None:
        """Load the newest complete checkpoint under ``directory``; with ``fallback``, an
        unreadable one is reported and the previous one tried (``on_skip(path, error)`` is told
        of each one skipped so)."""
        found = list_checkpoints(directory)
        errors = []
        for path in reversed(found):
            try:
                return self.load(path)
            except CheckpointError as exc:
                errors.append(str(exc))
                if not fallback:
                    raise
                if on_skip is not None:
                    on_skip(path, exc)
        if errors:
            raise CheckpointError("no loadable checkpoint:\n" + "\n".join(errors))
        return None

    def resume_from(self, path) -> dict:
        """Load an explicit checkpoint: a ``step_*`` directory, or the newest one inside a
        directory of checkpoints.  It may come from any layout and any run directory."""
        path = Path(path)
        if path.name.startswith("step_") and path.is_dir():
            return self.load(path)  # names what is wrong with it when it is incomplete
        if list_checkpoints(path):
            return self.resume_latest(path, fallback=False)
        raise CheckpointError(
            f"--resume {str(path)!r}: no complete checkpoint there (expected a step_* directory "
            "written by Trainer.save, or a directory holding them)"
        )
