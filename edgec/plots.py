"""PNG figures of `edgec eval` and `edgec bench` reports. matplotlib is imported here only, when a figure is drawn;
without it ``PlottingUnavailable`` says what to install (the JSON report does not need it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

INSTALL = "pip install matplotlib"


class PlottingUnavailable(Exception):
    """matplotlib is not installed (not an error of the command: its report is written all the same)."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlottingUnavailable(f"PNGs need matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _caption(report: dict[str, Any]) -> str:
    machine = report["machine"]
    cpu = machine.get("cpu", machine["platform"])  # reports written before the CPU model was recorded
    return f"{cpu}, {machine['cores']} cores (load {machine['load_average']}), {report['date']}"


def eval_plots(report: dict[str, Any], folder: Path) -> list[Path]:
    """The figures an eval report supports: passkey heat maps, the error curve, perplexity vs KV bytes (two or more
    bundles). Returns the files written."""
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (("passkey.png", _passkey), ("error-curve.png", _error_curve), ("perplexity-kv.png", _ppl_kv)):
        figure = draw(plt, report)
        if figure is not None:
            figure.savefig(folder / name, dpi=100)
            plt.close(figure)
            written.append(folder / name)
    return written


def _passkey(plt, report):
    bundles = [b for b in report["bundles"] if "passkey" in b]
    if not bundles:
        return None
    figure, axes = plt.subplots(
        1,
        len(bundles),
        figsize=(max(3.2 * len(bundles) + 1.4, 6), 3.8),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    for axis, bundle in zip(axes[0], bundles, strict=True):
        result = bundle["passkey"]
        accuracy = np.asarray(result["accuracy"])
        image = axis.imshow(accuracy, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        axis.set_xticks(range(len(result["depths"])), [f"{d:g}" for d in result["depths"]])
        axis.set_yticks(range(len(result["lengths"])), [str(n) for n in result["lengths"]])
        axis.set_xlabel("depth of the key")
        axis.set_title(bundle["name"], fontsize=9)
        for (i, j), value in np.ndenumerate(accuracy):
            axis.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=8)
    axes[0][0].set_ylabel("prompt tokens")
    figure.colorbar(image, ax=axes[0].tolist(), label="passkey accuracy")
    trials = bundles[0]["passkey"]["trials"]
    figure.suptitle(
        f"passkey retrieval, {trials} trial{'s' if trials > 1 else ''} per cell\n{_caption(report)}", fontsize=9
    )
    return figure


def _smooth(values: np.ndarray, width: int) -> np.ndarray:
    if width <= 1 or len(values) < width:
        return values
    return np.convolve(values, np.ones(width) / width, mode="valid")


def _error_curve(plt, report):
    bundles = [b for b in report["bundles"] if "error_curve" in b]
    if not bundles:
        return None
    figure, (kl_axis, delta_axis) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    width = max(1, bundles[0]["error_curve"]["tokens"] // 64)
    for index, bundle in enumerate(bundles):
        curve = bundle["error_curve"]
        kl = _smooth(np.asarray(curve["kl"]), width)
        delta = _smooth(np.asarray(curve["max_abs_logit"]), width)
        positions = np.arange(len(kl)) + (width - 1) / 2 if width > 1 else np.arange(len(kl))
        kl_axis.plot(positions, np.maximum(kl, 1e-12), color=f"C{index}", label=bundle["name"])
        delta_axis.plot(positions, delta, color=f"C{index}", label=bundle["name"])
    kl_axis.set_yscale("log")
    kl_axis.set_ylabel(f"KL(reference ‖ bundle), nats\n(mean of {width} positions; 0 drawn at 1e-12)")
    delta_axis.set_ylabel("max |Δlogit|")
    delta_axis.set_xlabel(
        f"position (tokens 0–{bundles[0]['error_curve']['prompt_tokens'] - 1} read as a prompt, then decode steps)"
    )
    kl_axis.legend(fontsize=8)
    reference = Path(report["reference"]["path"]).name if report.get("reference") else "reference"
    figure.suptitle(f"error accumulation vs {reference} — {_caption(report)}", fontsize=9)
    figure.tight_layout()
    return figure


def _ppl_kv(plt, report):
    bundles = [b for b in report["bundles"] if "perplexity" in b]
    if len(bundles) < 2:
        return None
    window = list(bundles[0]["perplexity"]["windows"])[-1]
    figure, axis = plt.subplots(figsize=(6.5, 4.2))
    for index, bundle in enumerate(bundles):
        kv = bundle["cache"]["bytes_at"][window] / 2**20
        ppl = bundle["perplexity"]["windows"][window]["perplexity"]
        axis.scatter([kv], [ppl], color=f"C{index}", s=50, label=f"{bundle['name']} ({describe_cache(bundle)})")
        axis.annotate(bundle["name"], (kv, ppl), textcoords="offset points", xytext=(6, 4), fontsize=7)
    reference = (report.get("reference") or {}).get("perplexity")
    if reference:
        axis.axhline(reference["windows"][window]["perplexity"], color="grey", linestyle="--", label="reference")
    axis.set_xlim(left=0, right=axis.get_xlim()[1] * 1.15)  # room for the labels
    axis.set_xlabel(f"KV cache MiB holding {window} tokens")
    axis.set_ylabel(f"perplexity, {window}-token windows")
    axis.legend(fontsize=8)
    axis.set_title(f"perplexity vs KV bytes — {_caption(report)}", fontsize=9)
    figure.tight_layout()
    return figure


def describe_cache(bundle: dict[str, Any]) -> str:
    """``fp32 weights, fp32 cache`` / ``int4 weights, 512 int8 slots``: what a bundle's point stands for."""
    compression = bundle["cache"].get("compression")
    cache = (
        f"{compression['capacity']} {compression['dtype']} slots"
        if compression
        else f"{bundle['cache']['dtype']} cache"
    )
    return f"{bundle['weights']} weights, {cache}"


def bench_plot(report: dict[str, Any], path: Path) -> Path:
    """Decode and prefill tokens/s against context (median, min–max over rounds), and peak RSS, per engine."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    contexts = report["contexts"]
    for index, engine in enumerate(report["engines"]):
        for axis, metric in zip(axes[:2], ("decode_tok_s", "prefill_tok_s"), strict=True):
            stats = [engine["results"][str(n)][metric] for n in contexts]
            medians = np.asarray([s["median"] for s in stats])
            spread = [medians - [s["min"] for s in stats], np.asarray([s["max"] for s in stats]) - medians]
            axis.errorbar(
                contexts, medians, yerr=spread, marker="o", capsize=3, color=f"C{index}", label=engine["name"]
            )
    axes[0].set_ylabel("decode tokens/s (median, min–max over rounds)")
    axes[1].set_ylabel("prefill tokens/s (median, min–max)")
    for axis in axes[:2]:
        axis.set_ylim(bottom=0)
        axis.set_xscale("log", base=2)
        axis.set_xticks(contexts, [str(n) for n in contexts])
        axis.set_xlabel("prompt tokens")
        axis.legend(fontsize=8)
    names = [engine["name"] for engine in report["engines"]]
    axes[2].barh(
        names,
        [(engine["peak_rss_bytes"] or 0) / 2**30 for engine in report["engines"]],
        color=[f"C{i}" for i in range(len(names))],
    )
    axes[2].set_xlabel(f"peak RSS, GiB (lower is better)\nload + {contexts[-1]}-token prompt + decode")
    for index, engine in enumerate(report["engines"]):
        if engine["peak_rss_bytes"]:
            axes[2].text(
                engine["peak_rss_bytes"] / 2**30, index, f" {engine['peak_rss_bytes'] / 2**30:.2f}", va="center"
            )
    axes[2].set_xlim(right=axes[2].get_xlim()[1] * 1.2)  # room for the labels
    axes[2].invert_yaxis()
    figure.suptitle(
        f"{report['threads'] or 'default'} threads, {report['rounds']} alternating rounds — {_caption(report)}",
        fontsize=9,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
