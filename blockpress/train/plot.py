"""Loss curves of a run (metrics history) as a PNG (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path


def plot_history(history: list[dict], path: str | Path, title: str = "training loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval_loss" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("loss", "-"), ("diff", "--"), ("ar", ":")):
        pts = [(h["step"], h[key]) for h in train if key in h]
        if any(v > 0 for _, v in pts):  # all-zero: a term that was off (e.g. --ar-weight 0)
            ax.plot(*zip(*pts), style, label=f"train {key}")
    for key in ("eval_loss", "eval_diff", "eval_ar"):
        pts = [(h["step"], h[key]) for h in evals if key in h]
        if any(v > 0 for _, v in pts):
            ax.plot(*zip(*pts), "o-", ms=3, label=key.replace("_", " "))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
