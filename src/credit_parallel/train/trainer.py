"""The parallel trainer (CREDIT's gen2 loop): one code path for 1 process or N ranks.

Per optimizer step: for each of ``grad_accum`` micro-batches (gradient sync suppressed until the
last) -> shard the dp batch over the domain ranks -> autoregressive rollout of ``forecast_len``
steps that stays sharded -> latitude-weighted MSE share (exact on uneven shards) -> backward.
Then domain-gradient sync (sum of shares), one non-finite check (the global gradient norm, which
every rank computes identically), global-norm clipping, AdamW and the LR schedule.

Data order is a pure function of the step (epoch = step // batches_per_epoch, the DP sampler
seeded per epoch), so a resumed run continues the exact trajectory of an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import parse_parallelism_conf
from ..domain.sharding import shard_batch
from ..mesh import data_parallel_coords
from .loss import latitude_weighted_mse_share, local_lat_weights

__all__ = ["NonFiniteError", "TrainConfig", "Trainer"]


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient under the ``stop`` policy."""


def _positive(conf: dict, key: str, default, kind=int, minimum=1):
    value = conf.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
    ):
        raise ValueError(f"trainer.{key} must be a {kind.__name__} >= {minimum}, got {value!r}")
    value = kind(value)
    if value < minimum:
        raise ValueError(f"trainer.{key} must be >= {minimum}, got {value!r}")
    return value


@dataclass
class TrainConfig:
    steps: int = 100
    batch_size: int = 2
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    amp: bool = False
    nonfinite: str = "stop"
    validate_every: int = 0
    val_batches: int = 2
    checkpoint_every: int = 0
    dtype: str = "float32"

    @classmethod
    def from_conf(cls, conf: dict) -> TrainConfig:
        t = conf.get("trainer") or {}
        if not isinstance(t, dict):
            raise ValueError("trainer must be a mapping")
        known = set(cls.__dataclass_fields__) | {
            "parallelism",
            "activation_checkpoint",
            "dist_timeout_s",
            "save_dir",
            "resume",
            "log_every",
            "domain_nonlocal_policy",  # domain/gather.py
            "domain_guard",  # domain/guard.py
        }
        unknown = sorted(set(t) - known)
        if unknown:
            raise ValueError(f"trainer has unknown key(s) {unknown}; known keys: {sorted(known)}")
        nonfinite = t.get("nonfinite", "stop")
        if nonfinite not in ("stop", "skip"):
            raise ValueError(f"trainer.nonfinite must be 'stop' or 'skip', got {nonfinite!r}")
        amp = t.get("amp", False)
        if not isinstance(amp, bool):
            raise ValueError(f"trainer.amp must be true or false, got {amp!r}")
        dtype = t.get("dtype", "float32")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"trainer.dtype must be 'float32' or 'float64', got {dtype!r}")
        return cls(
            steps=_positive(t, "steps", 100),
            batch_size=_positive(t, "batch_size", 2),
            grad_accum=_positive(t, "grad_accum", 1),
            lr=_positive(t, "lr", 1e-3, float, 0),
            weight_decay=_positive(t, "weight_decay", 0.0, float, 0),
            warmup_steps=_positive(t, "warmup_steps", 0, int, 0),
            min_lr_ratio=_positive(t, "min_lr_ratio", 0.1, float, 0),
            grad_clip=_positive(t, "grad_clip", 1.0, float, 0),
            seed=_positive(t, "seed", 0, int, 0),
            amp=amp,
            nonfinite=nonfinite,
            validate_every=_positive(t, "validate_every", 0, int, 0),
            val_batches=_positive(t, "val_batches", 2),
            checkpoint_every=_positive(t, "checkpoint_every", 0, int, 0),
            dtype=dtype,
        )


def _lr_lambda(tc: TrainConfig):
    def fn(step: int) -> float:
        if tc.warmup_steps and step < tc.warmup_steps:
            return (step + 1) / tc.warmup_steps
        span = max(1, tc.steps - tc.warmup_steps)
        progress = min(1.0, (step - tc.warmup_steps) / span)
        return tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def _world_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


class Trainer:
    """Builds model, data and optimizer from a config and trains under its parallel layout."""

    def __init__(self, conf: dict, *, dataset=None, val_dataset=None, model=None):
        from ..composition import get_domain_manager, parallelize
        from ..models import build_model
        from ..validate import check_run

        # every problem of the run (trainer keys, layout, model, data) at once, before anything
        check_run(conf, dist.get_world_size() if dist.is_initialized() else 1, dataset, model=model)
        self.conf = conf
        self.block = parse_parallelism_conf(conf)
        self.tc = TrainConfig.from_conf(conf)
        self.dtype = torch.float64 if self.tc.dtype == "float64" else torch.float32
        self.dp_rank, self.dp_size = data_parallel_coords(conf)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dataset = dataset if dataset is not None else self._build_dataset(conf, "train")
        self.val_dataset = val_dataset
        if self.val_dataset is None and self.tc.validate_every:
            self.val_dataset = self._build_dataset(conf, "valid")
        # identical initial weights on every rank
        torch.manual_seed(self.tc.seed)
        base = model if model is not None else build_model(conf["model"])
        base = base.to(self.dtype)
        self.model = parallelize(base, conf)
        self.manager = get_domain_manager(self.model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.tc.lr, weight_decay=self.tc.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(self.tc))
        self.step = 0
        self.history: list[dict] = []
        self.lat_weights = self.dataset.lat_weights.to(self.dtype)
        self.global_height = int(self.lat_weights.shape[0])
        self._lat_local = local_lat_weights(self.lat_weights, self.manager)
        self._replicas = self.world // self.dp_size  # ranks per dp replica (tp x domain)

    # ------------------------------------------------------------------ data
    @staticmethod
    def _build_dataset(conf: dict, split: str):
        from ..data.dataset import dataset_from_conf

        return dataset_from_conf(conf, split)

    def _batch_indices(self, step: int, micro: int, dataset, seed_offset: int = 0) -> list[int]:
        """Sample indices of micro-batch ``micro`` of ``step`` for this dp rank (pure)."""
        from ..data import DistributedDPSampler

        sampler = DistributedDPSampler(
            len(dataset), self.dp_rank, self.dp_size, shuffle=True, seed=self.tc.seed + seed_offset
        )
        per_rank = len(sampler)
        bs = self.tc.batch_size
        batches_per_epoch = per_rank // bs
        if batches_per_epoch < 1:
            raise ValueError(
                f"trainer.batch_size {bs} is larger than the {per_rank} samples each of the {self.dp_size} "
                "dp ranks gets per epoch; lower batch_size or add data"
            )
        flat = step * self.tc.grad_accum + micro
        epoch, j = divmod(flat, batches_per_epoch)
        sampler.set_epoch(epoch)
        order = list(iter(sampler))
        return order[j * bs : (j + 1) * bs]

    def _collate(self, dataset, indices) -> dict:
        samples = [dataset[i] for i in indices]
        out = {}
        for key in samples[0]:
            values = [s[key] for s in samples]
            out[key] = torch.stack([torch.as_tensor(v) for v in values])
        for key, value in out.items():
            if value.is_floating_point():
                out[key] = value.to(self.dtype)
        return out

    # ------------------------------------------------------------------ forward
    def _forward(self, *inputs):
        """The model's forward; under the opt-in domain guard (trainer.domain_guard /
        CREDIT_PARALLEL_DOMAIN_GUARD=1) a functional call over H on a shard raises."""
        from ..composition import get_domain_manager
        from ..domain.guard import debug_guard

        with debug_guard(self.model, self.conf) as guard:
            mgr = get_domain_manager(self.model)
            if mgr is not None and mgr.domain_world_size > 1:
                guard.mark(*inputs)
            return self.model(*inputs)

    def _rollout_loss(self, batch: dict) -> torch.Tensor:
        """Loss share of one (sharded) batch over the forecast steps, model applied
        autoregressively; the state stays sharded between steps."""
        ds = self.dataset
        if getattr(ds, "as_5d", False):
            inputs = (batch["x_upper"], batch["x_surface"])
            targets = (batch["y_upper"], batch["y_surface"])
            steps = ds.forecast_len
            total = 0.0
            state = inputs
            cu = targets[0].shape[1] // steps
            cs = targets[1].shape[1] // steps
            for k in range(steps):
                out = self._forward(*state)
                ty = (targets[0][:, k * cu : (k + 1) * cu], targets[1][:, k * cs : (k + 1) * cs])
                total = total + sum(
                    latitude_weighted_mse_share(o, t, self._lat_local, self.global_height)
                    for o, t in zip(out, ty)
                ) / len(out)
                if ds.history_len == 1:
                    state = out
            return total / steps
        x, y = batch["x"], batch["y"]
        steps = ds.forecast_len
        c_step = y.shape[1] // steps
        total = 0.0
        for k in range(steps):
            pred = self._forward(x)
            target = y[:, k * c_step : (k + 1) * c_step]
            total = total + latitude_weighted_mse_share(
                pred, target, self._lat_local, self.global_height
            )
            if k + 1 < steps:
                # history-major channels: drop the oldest step, append the prediction
                x = torch.cat([x[:, c_step:], pred.to(x.dtype)], dim=1)
        return total / steps

    def _autocast(self):
        use = self.tc.amp and self.block["data"] != "fsdp2"  # FSDP2 applies its own bf16 policy
        return torch.autocast(
            "cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16, enabled=use
        )

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        from ..collectives import clip_grad_norm_, sync_domain_gradients
        from ..fsdp import no_grad_sync

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        accum = self.tc.grad_accum
        for micro in range(accum):
            batch = self._collate(self.dataset, self._batch_indices(self.step, micro, self.dataset))
            batch = self._shard(batch)
            ctx = no_grad_sync(self.model) if micro + 1 < accum else contextlib.nullcontext()
            with ctx:
                with self._autocast():
                    share = self._rollout_loss(batch) / accum
                share.backward()
            loss_sum += share.detach().double().cpu()
        if self.manager is not None and self.manager.domain_world_size > 1:
            sync_domain_gradients(self.model, self.manager, op="sum")
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf")
        grad_norm = clip_grad_norm_(params, max_norm)
        # loss of the step: shares summed over domain, replicated over tp, averaged over dp
        loss = _world_sum(loss_sum.clone()) / (self._replicas // self._domain_size() * self.dp_size)
        finite = bool(torch.isfinite(grad_norm).item()) and bool(torch.isfinite(loss).item())
        record = {
            "step": self.step + 1,
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "lr": self.optimizer.param_groups[0]["lr"],
        }
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
        self.scheduler.step()
        self.step += 1
        self.history.append(record)
        return record

    def _shard(self, batch: dict) -> dict:
        """This rank's domain shard of a batch.  Only through the model's own manager:
        ``manager=None`` would fall back to a process-wide manager left by another layout."""
        return shard_batch(batch, manager=self.manager) if self.manager is not None else batch

    def _domain_size(self) -> int:
        return self.manager.domain_world_size if self.manager is not None else 1

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self) -> dict:
        """Area-weighted RMSE per output channel over ``val_batches`` batches, reduced over dp
        and domain (tp replicas hold identical values and are counted once)."""
        ds = self.val_dataset or self.dataset
        self.model.eval()
        sums = None
        count = torch.zeros((), dtype=torch.float64)
        for j in range(self.tc.val_batches):
            batch = self._collate(ds, self._batch_indices(j, 0, ds, seed_offset=10_000))
            batch = self._shard(batch)
            if "x" not in batch:
                return {}
            pred = self.model(batch["x"]).double()
            c = pred.shape[1]
            target = batch["y"][:, :c].double()
            w = self._lat_local.double().view(-1, 1)
            per_channel = ((pred - target) ** 2 * w).sum(dim=(0, 2, 3))
            sums = per_channel if sums is None else sums + per_channel
            count += pred.shape[0] * self.global_height * pred.shape[-1]
        self.model.train()
        tp = self._replicas // self._domain_size()
        sums = _world_sum(sums) / tp
        count = _world_sum(count.clone()) / (tp * self._domain_size())
        rmse = torch.sqrt(sums / count)
        names = getattr(ds, "variable_names", None) or [f"ch{i}" for i in range(len(rmse))]
        return {f"rmse/{n}": float(v) for n, v in zip(names, rmse)}

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory) -> Path:
        from ..checkpoint import config_hash, save_checkpoint

        return save_checkpoint(
            directory,
            self.step,
            self.model,
            self.optimizer,
            manifest={
                "layout": self.block,
                "world_size": self.world,
                "config_hash": config_hash(self.conf),
            },
        )

    def load(self, path) -> dict:
        from ..checkpoint import load_checkpoint

        manifest = load_checkpoint(path, self.model, self.optimizer)
        self.step = int(manifest["step"])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(self.tc), last_epoch=-1
        )
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * _lr_lambda(self.tc)(self.step)
        self.scheduler.last_epoch = self.step
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        return manifest

    def resume_latest(self, directory, *, fallback: bool = True) -> dict | None:
        """Load the newest complete checkpoint under ``directory``; with ``fallback``, an
        unreadable one is reported and the previous one tried."""
        from ..checkpoint import CheckpointError, list_checkpoints

        found = list_checkpoints(directory)
        errors = []
        for path in reversed(found):
            try:
                return self.load(path)
            except CheckpointError as exc:
                errors.append(str(exc))
                if not fallback:
                    raise
        if errors:
            raise CheckpointError("no loadable checkpoint:\n" + "\n".join(errors))
        return None
