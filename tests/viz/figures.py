"""What the viz tests share: a picture rendered to PNG, and the entries of an Axes' legend."""

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def render(fig) -> bytes:
    """The figure as PNG bytes (closed afterwards); fails when nothing was drawn."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=50)
    plt.close(fig)
    data = buf.getvalue()
    assert data.startswith(b"\x89PNG") and len(data) > 1000
    return data


def legend_texts(ax) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None, "no legend"
    return [t.get_text() for t in legend.get_texts()]
