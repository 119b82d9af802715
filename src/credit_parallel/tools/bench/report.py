"""The benchmark's reports: the one table, the targets, the chart and the Markdown page."""

from __future__ import annotations

from .suite import Row

__all__ = [
    "LEGEND",
    "NOTES",
    "evaluate_targets",
    "format_table",
    "target_status",
    "write_chart",
    "write_markdown",
]

_MIB = 2**20


def _mib(n: float) -> str:
    return f"{n / _MIB:.2f}"


def _kinds(c: dict) -> str:
    short = {
        "p2p": "p",
        "all_gather": "ag",
        "all_reduce": "ar",
        "reduce_scatter": "rs",
        "broadcast": "bc",
        "all_to_all": "a2a",
        "tp_weight_regroup": "rg",
    }
    parts = [f"{short[k]}{v}" for k, v in c.items() if v]
    return " ".join(parts) or "-"


_COLUMNS = [
    ("model", "model/size"),
    ("layout", "layout"),
    ("ovl", "ovl"),
    ("step", "step ms"),
    ("ref", "ref ms"),
    ("eff", "eff"),
    ("halo", "halo KiB/step meas/pred/min"),
    ("p2p", "p2p/exch"),
    ("coll", "collectives/step meas / pred"),
    ("saved", "saved MiB/rank"),
    ("savedr", "x d/1rk"),
    ("savedp", "pred MiB"),
    ("peak", "peak MiB/rank"),
    ("peakr", "x d/1rk"),
    ("halos", "halo ms"),
    ("hidden", "hidden"),
]


def _cells(row: Row) -> dict:
    overlap = "-" if row.overlap is None else ("on" if row.overlap else "off")
    halo = "-"
    if row.domain > 1:
        halo = (
            f"{row.halo_bytes / 1024:.0f} / {row.halo_bytes_predicted / 1024:.0f} / "
            f"{row.halo_bytes_minimum / 1024:.0f}"
        )
    return {
        "model": row.model,
        "layout": row.layout,
        "ovl": overlap,
        "step": f"{row.step_s * 1e3:.1f}",
        "ref": f"{row.reference_s * 1e3:.1f}",
        "eff": f"{row.efficiency:.3f}",
        "halo": halo,
        "p2p": "-" if row.p2p_per_exchange is None else f"{row.p2p_per_exchange:.2f}",
        "coll": f"{_kinds(row.collectives)} / {_kinds(row.collectives_predicted)}",
        "saved": _mib(row.saved_bytes),
        "savedr": f"{row.saved_ratio:.3f}",
        "savedp": _mib(row.saved_predicted_bytes),
        "peak": _mib(row.peak_bytes),
        "peakr": f"{row.peak_ratio:.3f}",
        "halos": "-" if row.domain == 1 else f"{row.halo_s * 1e3:.2f}",
        "hidden": "-" if row.halo_hidden is None else f"{row.halo_hidden:.2f}",
    }


def format_table(rows: list[Row]) -> str:
    """The one table of a run (plain text, aligned columns)."""
    cells = [_cells(r) for r in rows]
    header = {key: title for key, title in _COLUMNS}
    widths = {k: max(len(header[k]), *(len(c[k]) for c in cells)) for k, _ in _COLUMNS}
    left = {"model", "layout", "coll", "halo"}

    def line(c):
        return " | ".join(
            c[k].ljust(widths[k]) if k in left else c[k].rjust(widths[k]) for k, _ in _COLUMNS
        )

    out = [line(header), "-+-".join("-" * widths[k] for k, _ in _COLUMNS)]
    out += [line(c) for c in cells]
    return "\n".join(out)


LEGEND = (
    "step ms: median step (forward, backward, gradient sync) of the slowest rank; ref ms: 1 rank "
    "with as many threads as the layout has ranks and the same global batch; eff = ref/step. "
    "halo: bytes per step and domain group, measured / cost model / theoretical minimum. "
    "p2p/exch: batched P2P calls per exchange (1 = one batch_isend_irecv per layer and "
    "direction). collectives per rank and step by kind (p: batched P2P, ag: all-gather, ar: "
    "all-reduce, rs: reduce-scatter, bc: broadcast, rg: TP weight regroup), measured / cost model. "
    "saved: bytes saved for backward on the largest rank; peak: peak allocated bytes during a step "
    "above its start; 'x d/1rk' = per-rank value x domain / 1-rank value (1.00 = exactly 1/domain). "
    "halo ms: time per step blocked in exchanges (mean over ranks); hidden: share of the "
    "overlap-off halo time that overlap hides."
)


NOTES = (
    "Split convolution and overlap (domain/layers/split_conv.py): a convolution convolves straight from "
    "its shard (one zero-padded call for stride-1 'same' convs) and redoes only the boundary "
    "rows from small halo strips, forward and backward, without assembling a window; its "
    "backward sends the halo gradients before the shard's call.  Overlap only moves the "
    "forward's wait for the halo rows after the shard's call (bitwise the same results).  "
    "Default: on for CUDA, off on CPU (gloo's transfer threads compete with the convolution "
    "for the cores; measured slower on this 2-core machine); set it with "
    "credit_parallel.domain.layers.split_conv.set_model_overlap(model, True/False).",
    "Efficiency is measured against ONE process using as many intra-op threads as the layout "
    "has ranks, on the same global batch: 1.0 means domain/tensor/data parallelism over N "
    "processes is as fast as N threads in one process.  tp layouts replicate every layer that "
    "is not tensor-parallel, so they cannot reach 1.0 on these models.",
    "The machine is shared with other jobs and has 2 cores: layouts with 4 ranks (and the "
    "4-thread references) oversubscribe it, and all timings move with the load average shown "
    "above; the byte, call and memory figures do not depend on the load.",
    "Halo time is the time a rank is blocked in exchanges (posting plus waiting, including "
    "waiting for a slower neighbour); with overlap on, the computation between post and wait "
    "is not counted, so 'hidden' is the share of the overlap-off halo time that disappeared.",
    "The cost model's saved-activation estimate traces what autograd saves on the meta device "
    "(plus the halo-extended inputs and the model inputs); the measurement also holds what the "
    "loss saves, hence the small gap.",
)


def evaluate_targets(rows: list[Row], target_model: str = "conv_stack/large") -> list[dict]:
    """The issue's targets, each with the figures it was judged on and whether it is met
    (``met`` is None when this run did not measure it)."""
    targets = []
    dom = [r for r in rows if r.domain > 1]
    bad_halo = [r for r in dom if round(r.halo_bytes) != r.halo_bytes_minimum]
    targets.append(
        {
            "target": "halo bytes per step equal to the theoretical minimum",
            "met": None if not dom else not bad_halo,
            "figures": f"{len(dom) - len(bad_halo)}/{len(dom)} domain runs exactly at the minimum",
        }
    )
    calls = [r.p2p_per_exchange for r in dom if r.p2p_per_exchange is not None]
    targets.append(
        {
            "target": "one batched call per exchange",
            "met": None if not calls else all(abs(c - 1.0) < 1e-9 for c in calls),
            "figures": f"P2P calls per exchange: {sorted(set(round(c, 3) for c in calls))}",
        }
    )
    for d in (2, 4):
        cands = [r for r in rows if r.domain == d and r.dp == 1 and r.tp == 1]
        worst = max((r.saved_ratio for r in cands), default=None)
        targets.append(
            {
                "target": f"saved-activation bytes per rank at domain {d} <= 1.1/{d} of 1 rank",
                "met": None if worst is None else worst <= 1.1,
                "figures": "n/a"
                if worst is None
                else f"worst per-rank x {d} / 1-rank = {worst:.3f}",
            }
        )
    eff = [
        r
        for r in rows
        if r.model == target_model and r.domain == 2 and r.dp == 1 and r.tp == 1 and r.overlap
    ]
    targets.append(
        {
            "target": f"parallel efficiency at domain 2 for {target_model} >= 0.9 (overlap on)",
            "met": None if not eff else eff[0].efficiency >= 0.9,
            "figures": "n/a"
            if not eff
            else (
                f"{eff[0].efficiency:.3f} (step {eff[0].step_s * 1e3:.0f} ms vs 1 rank x 2 threads "
                f"{eff[0].reference_s * 1e3:.0f} ms)"
            ),
        }
    )
    hidden = [r.halo_hidden for r in eff if r.halo_hidden is not None]
    targets.append(
        {
            "target": f"overlap hides >= half of the halo time ({target_model}, domain 2)",
            "met": None if not hidden else hidden[0] >= 0.5,
            "figures": "n/a" if not hidden else f"hidden share {hidden[0]:.2f}",
        }
    )
    return targets


def target_status(met) -> str:
    return "n/a" if met is None else ("met" if met else "NOT met")


def write_chart(rows: list[Row], path: str) -> None:
    """bench.png: parallel efficiency per layout (scaling) and memory per rank x domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    layouts = list(dict.fromkeys(r.layout for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(1, len(models))
    for k, model in enumerate(models):
        mine = {r.layout: r for r in rows if r.model == model and r.overlap in (True, None)}
        xs = [
            i + (k - (len(models) - 1) / 2) * width
            for i, name in enumerate(layouts)
            if name in mine
        ]
        ax1.bar(xs, [mine[name].efficiency for name in layouts if name in mine], width, label=model)
        plain = sorted((r.domain, r) for r in mine.values() if r.dp == 1 and r.tp == 1)
        dom = [d for d, _ in plain]
        line = ax2.plot(
            dom, [r.saved_ratio / d for d, r in plain], marker="o", label=f"{model} saved"
        )[0]
        ax2.plot(
            dom,
            [r.peak_ratio / d for d, r in plain],
            marker="s",
            linestyle="--",
            color=line.get_color(),
            label=f"{model} peak",
        )
    ax1.set_xticks(range(len(layouts)))
    ax1.set_xticklabels(layouts)
    ax1.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    ax1.set_ylabel("T(1 rank, same threads) / T(layout)")
    ax1.set_title("parallel efficiency per layout (overlap on; dotted: 0.9)")
    ax1.tick_params(axis="x", rotation=30)
    ax1.legend(fontsize=8)
    ds = [1, 2, 4]
    ax2.plot(ds, [1 / d for d in ds], color="black", linestyle=":", label="1/domain")
    ax2.plot(ds, [1.1 / d for d in ds], color="grey", linestyle=":", label="1.1/domain")
    ax2.set_xlabel("domain ranks")
    ax2.set_ylabel("per-rank bytes / 1-rank bytes")
    ax2.set_title("memory per rank (saved for backward, peak)")
    ax2.set_xticks(ds)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_markdown(result: dict, path: str) -> None:
    """A page with the machine, the command, the table and the targets of one run."""
    m = result["machine"]
    lines = [
        "# Performance",
        "",
        "Figures of the latest `credit-parallel bench` run (regenerate them with the command "
        "below; the page is written by the benchmark itself).",
        "",
        f"- command: `{result['command']}`",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; Python {m['python']}, "
        f"torch {m['torch']}, {m['backend']}, 1 intra-op thread per rank",
        f"- load average (1/5/15 min) before / after: {result['loadavg_before']} / "
        f"{result['loadavg_after']} (the machine is shared; medians of {result['steps']} steps "
        f"after {result['warmup']} warm-up steps, x {result.get('rounds', 1)} interleaved rounds)",
        f"- date: {result['date']}, wall time {result['wall_s']:.0f} s",
        "",
        "Models:",
        "",
    ]
    lines += [f"- {d}" for d in result["models"]]
    lines += ["", "```", result["table"], "```", "", LEGEND, "", "## Targets", ""]
    lines += ["| target | met | figures |", "| --- | --- | --- |"]
    for t in result["targets"]:
        lines.append(f"| {t['target']} | {target_status(t['met'])} | {t['figures']} |")
    lines += ["", f"![scaling and memory]({result.get('chart', 'bench.png')})", ""]
    if result.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
