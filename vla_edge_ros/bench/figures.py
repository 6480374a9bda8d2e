"""Saving the benchmarks' matplotlib figures the same way (tight layout, 110 dpi, the figure closed so long
sweeps do not accumulate them)."""
from __future__ import annotations

from pathlib import Path


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
