"""The main job's final losses checked against the stored reference.

:data:`REFERENCE_FILE` (``reference.json``, package data beside this
module) holds the final validation losses of the default jobs on a
reference machine and the tolerance within which another machine should
match them; :func:`load_reference` reads it, :func:`reference_problem`
says what is wrong with a malformed one, :func:`reference_check` compares
a job's losses with it in one line.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

from decentral_jax import records

REFERENCE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "reference.json")


def reference_check(reference, job: str | None,
                    losses: dict[str, float]) -> str:
  """The job's final losses against the stored reference, one line.

  Args:
    reference: the contents of :data:`REFERENCE_FILE` (``{"tolerance":
      nats, "produced_on": words, "jobs": {job: {"final_loss": {"<method>/
      seed<k>": loss}}}}``), or None if it is missing. Any other shape is
      reported, not raised (:func:`reference_problem`).
    job: ``"quick"`` or ``"full"`` when this invocation is that job's
      default set-up (default config, no ``--config`` overrides, tuned
      learning rates), else None.
    losses: ``{"<method>/seed<k>": final validation loss}`` of this job.

  Returns:
    "matches the reference within X ...", "differs: ...", why there is
    nothing to compare, or "not checked: the reference file ... is
    malformed: key ...".
  """
  if reference is None:
    return f"no reference file ({REFERENCE_FILE})."
  problem = reference_problem(reference)
  if problem:
    return (f"not checked: the reference file {REFERENCE_FILE} is malformed:"
            f" {problem}; fix it or restore it with git.")
  stored = (reference.get("jobs", {}).get(job, {}).get("final_loss", {})
            if job else {})
  common = sorted(set(stored) & set(losses))
  if not common:
    return ("no stored reference for this set-up (the reference covers "
            "the default jobs' runs without --config overrides).")
  tol = float(reference["tolerance"])
  diffs = {k: losses[k] - float(stored[k]) for k in common}
  worst = max(abs(d) for d in diffs.values())
  where = f"reference produced on {reference.get('produced_on', '?')}"
  bad = [k for k in common if not abs(diffs[k]) <= tol]
  if not bad:
    return (f"matches the reference within {tol:g} nats (largest "
            f"difference {worst:.4f} over {len(common)} runs; {where}).")
  return ("differs: " + "; ".join(
      f"{k} {losses[k]:.4f} vs reference {float(stored[k]):.4f}"
      for k in bad) + f" (tolerance {tol:g} nats; {where}). Other "
      "versions of JAX/XLA or a changed library give other numbers.")


def _is_number(x) -> bool:
  """A finite real that is a float64 (a JSON integer may be any size)."""
  if not isinstance(x, numbers.Real) or isinstance(x, bool):
    return False
  try:
    return math.isfinite(float(x))
  except OverflowError:  # e.g. an integer of 400 digits
    return False


def reference_problem(reference) -> str | None:
  """What is wrong with the contents of :data:`REFERENCE_FILE` (naming the
  key, e.g. ``key 'jobs.quick.final_loss.dadam/seed0' is None, not a
  loss``), or None if it has the shape :func:`reference_check` reads."""
  kind = lambda x: f"{type(x).__name__} {x!r:.40}"
  if isinstance(reference, UnreadableReference):
    return f"it is not readable JSON ({reference.why})"
  if not isinstance(reference, dict):
    return f"its top level is a {kind(reference)}, not an object"
  tol = reference.get("tolerance")
  if not _is_number(tol) or tol < 0:
    return f"key 'tolerance' is {kind(tol)}, not a number of nats >= 0"
  jobs = reference.get("jobs", {})
  if not isinstance(jobs, dict):
    return f"key 'jobs' is {kind(jobs)}, not an object"
  for name, record in jobs.items():
    if not isinstance(record, dict):
      return f"key 'jobs.{name}' is {kind(record)}, not an object"
    finals = record.get("final_loss", {})
    if not isinstance(finals, dict):
      return (f"key 'jobs.{name}.final_loss' is {kind(finals)}, not an "
              "object")
    for run, loss in finals.items():
      if not _is_number(loss):
        return (f"key 'jobs.{name}.final_loss.{run}' is {kind(loss)}, not a "
                "loss")
  return None


@dataclasses.dataclass(frozen=True)
class UnreadableReference:
  """A reference file that is not readable JSON, and why."""
  why: str


def load_reference(path: str | None = None):
  """The contents of the reference file, None if there is none, or an
  :class:`UnreadableReference` (which :func:`reference_check` reports).
  ``path``: default :data:`REFERENCE_FILE`."""
  got = records.read_json(path or REFERENCE_FILE)
  if isinstance(got, records.Damaged):
    return None if got.missing else UnreadableReference(
        got.reason.removeprefix("is not JSON: ")[:120])
  return got
