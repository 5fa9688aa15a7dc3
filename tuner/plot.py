"""The sweep's figures: p99 against throughput, goodput and mean batch size against the
offered rate, one line per setting, the recommended cell starred."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .recommend import setting_key, setting_label


def plot(out: Path, rows: list[dict], slo_ms: float, rec: dict | None, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_setting: dict[tuple, list[dict]] = {}
    for r in rows:
        by_setting.setdefault(setting_key(r), []).append(r)
    keys = sorted(by_setting)
    cmap = plt.get_cmap("tab20" if len(keys) > 10 else "tab10")
    styles: dict[tuple, dict[str, Any]] = {
        k: {
            "color": cmap(i % cmap.N),
            "marker": "os^Dv<>ph*"[i % 10],
            "linestyle": ["-", "--", ":", "-."][(i // 10) % 4],
        }
        for i, k in enumerate(keys)
    }

    def figure(name: str, xlabel: str, ylabel: str, series, extra=None, logy=False) -> Path:
        fig, ax = plt.subplots(figsize=(9.5, 5.5), dpi=110)
        for k in keys:
            pts = [
                (x, y)
                for x, y in series(sorted(by_setting[k], key=lambda r: float(r["rate"])))
                if x is not None and y is not None
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=setting_label(by_setting[k][0]), **styles[k])
        if extra:
            extra(ax)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        return path

    def num(r: dict, k: str) -> float | None:
        v = r.get(k)
        return None if v in (None, "") else float(v)

    def recommended(ax, x: float, y: float) -> None:
        ax.plot(
            [x],
            [y],
            marker="*",
            markersize=18,
            color="gold",
            markeredgecolor="black",
            linestyle="none",
            label="recommended",
            zorder=5,
        )

    def slo_line(ax) -> None:
        ax.axhline(slo_ms, color="crimson", linestyle="--", linewidth=1, label=f"SLO p99 {slo_ms:g} ms")
        if rec is not None and num(rec, "p99_ms") is not None:
            recommended(ax, float(rec["throughput_rps"]), float(rec["p99_ms"]))

    def offered(ax) -> None:
        rates = sorted({float(r["rate"]) for r in rows})
        ax.plot(rates, rates, color="grey", linestyle=":", linewidth=1, label="offered rate")
        if rec is not None:
            recommended(ax, float(rec["rate"]), float(rec["goodput_rps"]))

    return [
        figure(
            "p99_vs_throughput.png",
            "throughput (successful requests/s)",
            "p99 latency (ms, log)",
            lambda rs: [(num(r, "throughput_rps"), num(r, "p99_ms")) for r in rs],
            slo_line,
            logy=True,
        ),
        figure(
            "goodput_vs_rate.png",
            "offered arrival rate (requests/s)",
            f"goodput (requests/s within {slo_ms:g} ms)",
            lambda rs: [(float(r["rate"]), num(r, "goodput_rps")) for r in rs],
            offered,
        ),
        figure(
            "batch_size_vs_rate.png",
            "offered arrival rate (requests/s)",
            "mean batch size (items, Ferry metrics)",
            lambda rs: [(float(r["rate"]), num(r, "mean_batch_size")) for r in rs],
        ),
    ]
