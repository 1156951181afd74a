"""Loss curves of a run (metrics history) as a PNG (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path


def plot_history(history: list[dict], path: str | Path, title: str = "training loss",
                 eval_on: str | None = None) -> list[str]:
    """Write the PNG; returns the labels of the curves drawn. eval_on: what the eval curves ran on, in their labels
    ("training examples" where a run has no eval data of its own)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval_loss" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    def drawn(rows, loss, diff, ar):
        """The curves worth drawing: no all-zero term (e.g. --ar-weight 0), and no diffusion term that is
        the whole loss anyway."""
        has_ar = any(h.get(ar, 0) > 0 for h in rows)
        return [k for k in (loss, diff, ar) if any(h.get(k, 0) > 0 for h in rows) and (has_ar or k != diff)]

    for key in drawn(train, "loss", "diff", "ar"):
        style = {"loss": "-", "diff": "--", "ar": ":"}[key]
        ax.plot(*zip(*[(h["step"], h[key]) for h in train if key in h]), style, label=f"train {key}")
    for key in drawn(evals, "eval_loss", "eval_diff", "eval_ar"):
        label = key.replace("_", " ") + (f" ({eval_on})" if eval_on else "")
        ax.plot(*zip(*[(h["step"], h[key]) for h in evals if key in h]), "o-", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    labels = [line.get_label() for line in ax.get_lines()]
    plt.close(fig)
    return labels
