"""Memory of the runner's train step under the memory controls.

Compiles one train-step program of the GPT-2 small config
(``configs/gpt2_small_owt.py``, decentralized: AccumAdamW on AER) for one
host of 8 workers at 30 x 1024 tokens per worker, once per combination of
``micro_batches``, ``model.remat``, ``model.dtype`` and
``model.param_dtype``, and reads XLA's ``memory_analysis()`` of the
compiled program: per device, the arguments (the state and the batch), the
outputs, the bytes they share (the donated state), and the temporaries
(activations kept for the backward pass, gradients, the gossip's receive
buffers, workspace). The peak is ``arguments + outputs - aliased +
temporaries``. Nothing is placed on a device: the inputs are abstract.

``--target h100_sxm`` (default) compiles deviceless for 8 H100s (needs the
CUDA compile plugin of ``requirements-gpu-compile.txt``, no GPU; about a
minute per combination on 2 cores); ``--target cpu`` compiles for 8
simulated CPU devices (``--tiny`` shrinks the model for a quick look).
Results: ``benchmarks/studies/18_memory.md``::

  JAX_PLATFORMS=cpu python benchmarks/bench_memory.py --json memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (name, overrides): each combination the study compiles.
COMBOS = (
    ("fp32", {"model.dtype": "float32"}),
    ("bf16 compute", {}),
    ("bf16 + remat block_dots", {"model.remat": "block_dots"}),
    ("bf16 + remat block", {"model.remat": "block"}),
    ("bf16 + micro 2", {"micro_batches": 2}),
    ("bf16 + micro 5", {"micro_batches": 5}),
    ("bf16 + remat block + micro 5", {"model.remat": "block",
                                      "micro_batches": 5}),
    ("bf16 params + remat block", {"model.param_dtype": "bfloat16",
                                   "model.remat": "block"}),
)
TINY = {"model.n_layer": 2, "model.n_embd": 64, "model.n_head": 2,
        "model.block_size": 64, "model.vocab_size": 512}


def make_config(overrides: dict, tiny: bool):
  """The GPT-2 small config on one host of 8 workers (4 per node, AER),
  30 sequences per worker, bundled text (only shapes are read)."""
  from decentral_jax.runner import config as config_lib
  c = config_lib.load_config(os.path.join(ROOT, "configs",
                                          "gpt2_small_owt.py"), [])
  c.n_workers, c.global_batch = 8, 240
  c.data.source, c.data.val_fraction = "pydoc", 0.1
  c.eval_batches = 1
  for name, value in {**(TINY if tiny else {}), **overrides}.items():
    *groups, last = name.split(".")
    target = c
    for g in groups:
      target = target[g]
    target[last] = value
  return c


def measure(overrides: dict, target: str, tiny: bool) -> dict:
  """Per-device bytes of one compiled train step (``memory_analysis()``)."""
  from decentral_jax.runner import experiment as experiment_lib
  from decentral_jax.tools import gpu_compile
  c = make_config(overrides, tiny)
  t0 = time.perf_counter()
  first = lambda exp: exp.programs.keys()[:1]
  if target == "cpu":
    exp = experiment_lib.Experiment(c)
    [step] = gpu_compile.compile_programs(exp, first)
  else:
    exp, [step] = gpu_compile.compile_steps(c, target=target,
                                            topology="1x1x8", programs=first)
  m = step.compiled.memory_analysis()
  out = {"arguments": m.argument_size_in_bytes,
         "outputs": m.output_size_in_bytes,
         "aliased": m.alias_size_in_bytes,
         "temporaries": m.temp_size_in_bytes,
         "params": exp.param_count}
  out["peak"] = (out["arguments"] + out["outputs"] - out["aliased"]
                 + out["temporaries"])
  out["compile_s"] = round(time.perf_counter() - t0, 1)
  return out


def _target(text: str) -> str:
  """An argparse ``type``: ``cpu``, a shipped GPU target or a .txtpb file."""
  from decentral_jax.tools import overlap_flags
  why = None if text == "cpu" else overlap_flags.target_error(text)
  if why:
    raise argparse.ArgumentTypeError(f"{why}, or cpu")
  return text


def parse_args(argv=None) -> argparse.Namespace:
  """The flags; a bad one exits with code 2 after one ``error:`` line."""
  from decentral_jax.tools import flag_types
  parser = flag_types.Parser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h100_sxm", type=_target,
                      help="h100_sxm, h200, a100_sxm_80 (deviceless) or cpu")
  parser.add_argument("--tiny", action="store_true",
                      help="a 2-layer, width-64 GPT instead of GPT-2 small")
  parser.add_argument("--only", default=None, type=flag_types.number_list(
      flag_types.integer(0, len(COMBOS) - 1), unique=True),
                      help="comma-separated indices of COMBOS to compile "
                      f"(0 to {len(COMBOS) - 1}; default all)")
  parser.add_argument("--json", default=None, help="write the results here")
  args = parser.parse_args(argv)
  try:
    flag_types.check_output_file(args.json, "--json")
  except ValueError as e:
    parser.error(str(e))
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.target == "cpu":
    import _common  # pylint: disable=import-outside-toplevel
    _common.set_cpu_devices(8)
    _common.check_cpu_devices(8, "bench_memory.py --target cpu", flag=False)
  picks = args.only if args.only is not None else range(len(COMBOS))
  rows = []
  gb = 2.0**(20 if args.tiny else 30)
  unit = "MiB" if args.tiny else "GiB"
  print(f"| combination | arguments | temporaries | peak ({unit}) | "
        "compile s |")
  print("|---|---|---|---|---|")
  for i in picks:
    name, overrides = COMBOS[i]
    r = measure(overrides, args.target, args.tiny)
    rows.append({"name": name, "overrides": overrides, **r})
    print(f"| {name} | {r['arguments'] / gb:.3f} | "
          f"{r['temporaries'] / gb:.3f} | {r['peak'] / gb:.3f} | "
          f"{r['compile_s']} |", flush=True)
    if args.json:
      from decentral_jax.tools import flag_types  # pylint: disable=import-outside-toplevel
      flag_types.write_output(args.json, "--json", lambda f: json.dump(
          {"target": args.target, "tiny": args.tiny, "rows": rows}, f,
          indent=1), kept="the rows were printed above")
  return 0


if __name__ == "__main__":
  sys.exit(main())
