"""A PNG of the scheduled step: compute phases and collectives on a clock.

Draws :class:`decentral_jax.analysis.timeline.Timeline` objects with
matplotlib (Agg, no display): per program one panel with a compute lane
(forward, backward and other bars) and one lane per collective of at least
``min_bytes`` bytes, from its start to its done (the priced transfer
hatched from the start). Two programs (a before/after pair) are two
panels on one time axis. ``decentral-jax overlap --timeline`` writes one
next to its table.
"""

from __future__ import annotations

from typing import Sequence

from decentral_jax.analysis import timeline as timeline_lib

COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "other": "#8c8c8c"}


def lanes(tl: timeline_lib.Timeline, min_bytes: float = 0.0) -> list:
  """``[(label, [(start_us, end_us, color, hatched)])]``: what a panel
  draws, top to bottom (the compute lane, then each collective of at least
  ``min_bytes`` bytes in start order)."""
  out = [("compute", [(p.start_us, p.end_us, COLORS[p.phase], False)
                      for p in tl.phases])]
  for c in tl.collectives:
    if c.bytes < min_bytes:
      continue
    bars = [(c.start_us, c.done_us, "#55a868" if c.is_async else "#c44e52",
             False)]
    if c.transfer_us:
      bars.append((c.start_us, c.start_us + c.transfer_us, "none", True))
    out.append((f"{c.kind} {c.bytes / 2**20:.1f} MiB", bars))
  return out


def save_png(path: str, timelines: Sequence[timeline_lib.Timeline],
             titles: Sequence[str], min_bytes: float = 0.0) -> list:
  """Writes the panels of ``timelines`` (one or two) to ``path``.

  Returns:
    The :func:`lanes` of each panel (what was drawn).

  Raises:
    ValueError: no timeline, or ``titles`` of another length.
  """
  if not timelines or len(titles) != len(timelines):
    raise ValueError(f"save_png: {len(timelines)} timeline(s) and "
                     f"{len(titles)} title(s); give one title per timeline.")
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import patches
  from matplotlib import pyplot as plt
  drawn = [lanes(t, min_bytes) for t in timelines]
  rows = [len(d) for d in drawn]
  fig, axes = plt.subplots(len(timelines), 1, sharex=True, squeeze=False,
                           figsize=(11, 1.2 + 0.32 * sum(rows)),
                           gridspec_kw={"height_ratios": rows})
  for ax, d, tl, title in zip(axes[:, 0], drawn, timelines, titles):
    for y, (_, bars) in enumerate(d):
      for start, end, color, hatched in bars:
        ax.broken_barh([(start, max(end - start, 1e-9))], (y - 0.4, 0.8),
                       facecolors=color, edgecolor="black" if hatched
                       else "none", hatch="///" if hatched else None,
                       linewidth=0.5)
    ax.set_yticks(range(len(d)), [label for label, _ in d], fontsize=7)
    ax.set_ylim(len(d) - 0.5, -0.5)
    ax.set_title(f"{title} ({tl.total_us / 1e3:,.2f} ms)", fontsize=9)
  axes[-1, 0].set_xlabel(f"us on the step's clock ({timelines[0].clock})")
  handles = [patches.Patch(color=c, label=p) for p, c in COLORS.items()]
  handles += [patches.Patch(color="#55a868", label="collective, async"),
              patches.Patch(color="#c44e52", label="collective, sync"),
              patches.Patch(facecolor="none", edgecolor="black", hatch="///",
                            label="priced transfer")]
  fig.legend(handles=handles, fontsize=7, ncol=6, loc="upper center")
  fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
  from decentral_jax.tools import flag_types  # pylint: disable=import-outside-toplevel
  flag_types.write_output(path, "--timeline",
                          lambda f: fig.savefig(f, dpi=110, format="png"),
                          mode="wb")
  plt.close(fig)
  return drawn


__all__ = ("COLORS", "lanes", "save_png")
