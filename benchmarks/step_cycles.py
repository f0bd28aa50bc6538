"""Where the distillation step's time goes on a TPU, without a TPU: the TPU compiler's own estimate, per instruction.

The step `tpu_step.py` measures (a pair of `bench.chip_pairs`, a `Setting`: batch, sequence, remat, loss chunk,
attention, splash blocks, AdamW's first moment, metrics-light) is built on abstract arrays
(`meshdistill.planner._compile.abstract_distiller`, the `Distiller`'s own step) and compiled for one device of a TPU
topology on this host (libtpu; ``v5e:2x2`` by default: libtpu refuses a one-chip topology, and one device of it is
the one-chip program, with no collectives). XLA:TPU writes an ``estimated_cycles`` on every instruction it
schedules; each is counted times its runs per step (loops whole: the scanned blocks, the chunked loss;
`meshdistill.train.cost.parse`) and grouped the ways a profile by op is read:

- by kind: a fusion by its XLA kind (``fusion:kLoop``, ``fusion:kOutput`` ...) with ``+dot`` when it holds a dot or
  convolution (a matmul), every other instruction by its op (``copy``, ``transpose``, ``add``, ``reduce`` ...);
- by source file and by source line: the innermost frame of the instruction's call stack in the package, optax or
  flax (else the innermost of all), ``file:line`` (a matmul fusion: its matmul's; another fusion: its largest
  instruction's);
- the single instructions, largest first, with runs per step, shape and ``op_name``.

The Mosaic kernels (``tpu_custom_call``: splash, the package's Pallas kernels) carry no estimate: their runs per
step are listed by name, and the attention kernels' time is their executed FLOPs at the chip's peak (the planner's
``kernel_s``).

Cycles are read at the chip's clock (``--ghz``, 1.5 for a v5e) as milliseconds. They are the compiler's cost model,
not a measurement; the head line also gives the planner's chip-calibrated step (`meshdistill.train.cost`
``CHIP_CALIBRATION``, fitted by `plan_chip.py` on steps measured on a v5e: seconds per estimated cycle of matmul
fusions and of the rest, plus the splash kernels at the share of peak they reach), the closest this host gets to
the chip's own time. Compare two programs' estimates; measure the change on the chip (`tpu_step.py --profile`).

  python benchmarks/step_cycles.py --pair qwen3 --config b=4,remat=dots_no_batch,chunk=1024,attn=splash
  python benchmarks/step_cycles.py --pair qwen3 --config b=4,remat=dots_no_batch --save-hlo /tmp/q4.hlo.gz
  python benchmarks/step_cycles.py --hlo /tmp/q4.hlo.gz --top 50 --grep copy    # a saved program, no compile
  python benchmarks/step_cycles.py --hlo /tmp/after.hlo.gz --before /tmp/q4.hlo.gz   # the change, by kind and source

Prints the tables (Markdown); ``--out FILE`` also writes them as the section of this pair and setting in FILE
(`benchmarks/results/step_cycles.md`), under the commit of the program (``--commit``, default this checkout's HEAD;
``--before-commit`` the other's), the date, the jax and libtpu versions and the command. Compiling the headline
pair's step takes one to a few minutes of CPU.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gzip
import os
import re
import shlex
import subprocess
import sys
import time

from bench.chip_pairs import PAIRS, Setting, model_configs
from bench.chip_step import use_splash_blocks
from bench.op_kinds import stack_frames
from bench.results import libtpu_version, replace_section

_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_KIND = re.compile(r"\bkind=(k\w+)")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SRC = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8\w*)\[([\d,]*)\]")
# frames worth naming: the package's own code first, then the libraries it calls
_OURS = ("meshdistill/", "optax/", "flax/")


@dataclasses.dataclass
class Instr:
  """One scheduled instruction: its cycles per run, runs per step, kind, source and what it makes."""

  name: str
  cycles: int
  runs: int
  kind: str
  source: str
  shape: str
  op_name: str

  @property
  def total(self) -> int:
    return self.cycles * self.runs


def _short(path: str) -> str:
  for key in _OURS:
    if key in path:
      return key + path.split(key, 1)[1]
  return path.rsplit("site-packages/", 1)[-1]


def _source(line: str, stacks: dict[int, list[tuple[str, int]]]) -> str:
  """``file:line`` of the instruction's innermost frame in the package (or optax, flax), else its innermost frame."""
  chain: list[tuple[str, int]] = []
  fid = _FRAME.search(line)
  if fid:
    chain = stacks.get(int(fid.group(1)), [])
  src = _SRC.search(line)
  if src:
    chain = [(src.group(1), int(src.group(2)))] + chain
  for key in _OURS:
    for f, ln in chain:
      if key in f:
        return f"{_short(f)}:{ln}"
  return f"{_short(chain[0][0])}:{chain[0][1]}" if chain else "?"


def _elements(text: str) -> int:
  m = _ARRAY.search(text)
  if not m:
    return 0
  n = 1
  for d in filter(None, m.group(2).split(",")):
    n *= int(d)
  return n


def instructions(hlo: str) -> tuple[list[Instr], collections.Counter]:
  """Every scheduled instruction carrying an estimate, with its runs per step; and the runs of each Mosaic kernel
  (``tpu_custom_call``: splash, the package's Pallas kernels), which carry none, by name. The compiler's own custom
  calls without an estimate (``ConcatBitcast``, ``AllocateBuffer``: buffer bookkeeping) are left out."""
  from meshdistill.train import cost  # the program's loops and their trip counts

  prog = cost.parse(hlo)
  stacks = stack_frames(hlo)
  comps = {name: text.splitlines() for name, text in prog.computations.items()}
  inner = set()
  for text in prog.computations.values():
    inner.update(cost._INNER.findall(text))
  out, kernels = [], collections.Counter()
  for comp, lines in comps.items():
    runs = prog.times.get(comp)
    if runs is None or comp in inner:
      continue
    for line in lines:
      m = _INSTR.match(line)
      if m is None:
        continue
      name, shape, op, _ = m.groups()
      cyc = _CYCLES.search(line)
      if cyc is None:
        target = _TARGET.search(line)
        if op == "custom-call" and target and target.group(1) == "tpu_custom_call":  # a Mosaic kernel, by its name
          kernels[name.rsplit(".", 1)[0]] += runs
        continue
      kind, where = op, line
      if op == "fusion":
        fk = _KIND.search(line)
        called = _CALLS.search(line)
        body = comps.get(called.group(1), []) if called else []
        dot = any(" convolution(" in b or " dot(" in b for b in body)
        kind = f"fusion:{fk.group(1) if fk else '?'}{'+dot' if dot else ''}"
        if dot:  # a matmul fusion is where its matmul came from
          where = next((b for b in body if " convolution(" in b or " dot(" in b), line)
        elif body:  # else where its largest instruction came from
          where = max(body, key=lambda b: (_elements(b.split("=", 1)[-1]), "metadata" in b))
        if "metadata" not in where:
          where = line
      op_name = _OP_NAME.search(where) or _OP_NAME.search(line)
      out.append(Instr(name, int(cyc.group(1)), runs, kind, _source(where, stacks), shape.split("{")[0].strip(),
                       op_name.group(1) if op_name else ""))
  return out, kernels


def grouped(instrs: list[Instr], key) -> list[tuple[str, int, int]]:
  """(group, cycles per step, instructions) by ``key(instr)``, largest first."""
  cyc, n = collections.Counter(), collections.Counter()
  for i in instrs:
    cyc[key(i)] += i.total
    n[key(i)] += 1
  return [(k, c, n[k]) for k, c in cyc.most_common()]


_GROUPS = {"kind": lambda i: i.kind, "file": lambda i: i.source.rsplit(":", 1)[0], "line": lambda i: i.source}


def _ms(cycles: float, ghz: float) -> float:
  return cycles / ghz / 1e6


def table(title: str, rows, ghz: float, total: int, top: int, before: dict | None = None) -> str:
  head = f"| {title} | est. ms | share | instructions |" + (" before ms | change ms |" if before is not None else "")
  sep = "|---|---:|---:|---:|" + ("---:|---:|" if before is not None else "")
  lines = [head, sep]
  keys = [r[0] for r in rows[:top]]
  if before is not None:  # the groups that moved most come first
    every = {r[0]: r for r in rows}
    moved = sorted(set(every) | set(before), key=lambda k: -abs((every.get(k, (k, 0, 0))[1]) - before.get(k, 0)))
    keys = moved[:top]
    rows = [every.get(k, (k, 0, 0)) for k in keys]
  for k, c, n in rows[:top]:
    cell = k.replace("|", "\\|")
    line = f"| `{cell}` | {_ms(c, ghz):.2f} | {100 * c / max(total, 1):.1f}% | {n} |"
    if before is not None:
      line += f" {_ms(before.get(k, 0), ghz):.2f} | {_ms(c - before.get(k, 0), ghz):+.2f} |"
    lines.append(line)
  return "\n".join(lines)


def compile_hlo(pair: str, s: Setting, topology: str, layers: tuple[int, int] | None = None) -> tuple[str, float, dict]:
  """The TPU program text of ``pair`` at ``s`` compiled for one device of ``topology``, its compile seconds and its
  memory. ``layers``: the teacher's and the student's first layers only (a shallow copy of the pair: the same program
  per layer, compiled in a fraction of the time)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import meshdistill as md
  from meshdistill.parallel.mesh import make_mesh
  from meshdistill.planner import parse_target
  from meshdistill.planner._compile import abstract_distiller, compile_step

  tcfg, scfg = model_configs(pair, s)
  if layers is not None:
    tcfg, scfg = tcfg.with_layers(range(layers[0])), scfg.with_layers(range(layers[1]))
  target = parse_target(topology, None)
  mesh = make_mesh(1, 1, devices=list(target.devices[:1]))
  strategy = md.ChunkedLogitKD(temperature=2.0, alpha=0.5, chunk_size=s.chunk, loss_kernel=s.loss)
  with use_splash_blocks(s.blocks):
    d = abstract_distiller(tcfg, scfg, strategy, s.optimizer(), mesh)
    if s.metrics == "light":
      d = d.metrics_light()
    t0 = time.perf_counter()
    c = compile_step(d, s.b, s.t)
  if c.oom:
    raise SystemExit(f"{pair} {s.label()}: the TPU compiler ran out of memory: {c.oom}")
  return c.hlo, time.perf_counter() - t0, {"memory_gib": c.memory.total_bytes / 2**30}


def kernel_seconds(pair: str, s: Setting, topology: str, layers: tuple[int, int] | None = None) -> float | None:
  """The attention kernels' executed FLOPs of the step at the chip's peak (`meshdistill.planner._compile.kernel_flops`,
  the planner's ``kernel_s``): what the compiler's estimate leaves out. None off a TPU topology the planner knows."""
  from meshdistill.planner import TPU_CHIPS
  from meshdistill.train.cost import kernel_flops

  tcfg, scfg = model_configs(pair, s)
  if layers is not None:
    tcfg, scfg = tcfg.with_layers(range(layers[0])), scfg.with_layers(range(layers[1]))
  chip = TPU_CHIPS.get(topology.split(":")[0])
  return None if chip is None else kernel_flops(tcfg, scfg, scfg.remat, s.t, executed=True) * s.b * s.t / \
      chip.peak_bf16_flops


def calibrated_ms(hlo: str, kernel_s: float | None, topology: str) -> float | None:
  """The planner's chip-calibrated step of a program for ``topology`` (`ChipCalibration.step_seconds` of the
  compiler's matmul / other cycles, `meshdistill.train.cost.estimated_cycles`, the kernels' executed-FLOP time and
  the streaming kernels' bytes at the chip's HBM bandwidth), in ms; None for another generation than the one the
  chip source was measured on."""
  from meshdistill.train import cost

  cal, cycles = cost.CHIP_CALIBRATION, cost.estimated_cycles(cost.parse(hlo))
  if cal is None or cycles is None or kernel_s is None or topology.split(":")[0] != cal.generation:
    return None
  return 1e3 * cal.step_seconds(cycles["matmul"], cycles["other"], kernel_s, cycles["kernel_bytes"])


def report(hlo: str, ghz: float, top: int, grep: str | None, before_hlo: str | None, extra: dict,
           topology: str = "v5e:2x2") -> str:
  """The Markdown tables: by kind, by file and by line (with the change from ``before_hlo`` where given: the groups
  that moved most first; an edited file's lines move too, so its file's row is the one to read), kind at line, and
  the instructions (those whose kind, source, op_name, shape or name holds ``grep``)."""
  instrs, kernels = instructions(hlo)
  total = sum(i.total for i in instrs)
  old = None
  if before_hlo is not None:
    old_instrs, _ = instructions(before_hlo)
    old = {name: {k: c for k, c, _ in grouped(old_instrs, key)} for name, key in _GROUPS.items()}
    old["total"] = sum(i.total for i in old_instrs)
  out = [f"Estimated cycles of the scheduled instructions: {total:,} = {_ms(total, ghz):.1f} ms at {ghz} GHz"
         + (f" (before: {_ms(old['total'], ghz):.1f} ms, change {_ms(total - old['total'], ghz):+.1f} ms)"
            if old else "")]
  ks = extra.get("kernel_s")
  if kernels:
    runs = ", ".join(f"{k} x{n}" for k, n in kernels.most_common())
    out.append(f"Mosaic kernels (no estimate; runs per step): {runs}"
               + (f"; the attention kernels' executed FLOPs at peak: {1e3 * ks:.1f} ms" if ks else ""))
  cal = calibrated_ms(hlo, ks, topology)
  if cal is not None:
    was = calibrated_ms(before_hlo, ks, topology) if before_hlo is not None else None
    out.append(f"Chip-calibrated step (the planner's v5e source): {cal:.1f} ms"
               + (f" (before: {was:.1f} ms, change {cal - was:+.1f} ms)" if was is not None else ""))
  if "memory_gib" in extra:
    out.append(f"Program memory (arguments + outputs + temporaries): {extra['memory_gib']:.2f} GiB")
  out.append("")
  for name, key in _GROUPS.items():
    out.append(table(name, grouped(instrs, key), ghz, total, top, old and old[name]))
    out.append("")
  out.append(table("kind @ line", grouped(instrs, lambda i: f"{i.kind} @ {i.source}"), ghz, total, top))
  out.append("")
  chosen = [i for i in instrs if grep is None or grep in f"{i.kind} {i.source} {i.op_name} {i.shape} {i.name}"]
  chosen.sort(key=lambda i: -i.total)
  out.append("| instruction | kind | est. ms | runs | shape | source | op_name |")
  out.append("|---|---|---:|---:|---|---|---|")
  for i in chosen[:top]:
    out.append(f"| {i.name} | {i.kind} | {_ms(i.total, ghz):.2f} | {i.runs} | {i.shape} | {i.source} | "
               f"{i.op_name[-90:]} |")
  return "\n".join(out)


def _read(path: str) -> str:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    return f.read()


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--pair", default="qwen3", choices=sorted(PAIRS))
  ap.add_argument("--config", default="b=4,remat=dots_no_batch,chunk=1024,attn=splash",
                  help="a tpu_step.py setting: b=,t=,remat=,chunk=,attn=,blocks=,mu=,metrics=,scan=,dtypes=")
  ap.add_argument("--topology", default="v5e:2x2", help="compiled for one device of this TPU topology")
  ap.add_argument("--layers", default=None, help="T,S: compile the teacher's first T and the student's first S "
                  "layers only (a quick look at one layer's program; the step's totals are then not the pair's)")
  ap.add_argument("--ghz", type=float, default=1.5, help="the chip's clock, cycles to milliseconds (v5e: 1.5)")
  ap.add_argument("--top", type=int, default=30, help="rows per table")
  ap.add_argument("--grep", default=None, help="the instructions table only where kind, source, op_name, shape or "
                  "name holds this text")
  ap.add_argument("--save-hlo", default=None, help="write the compiled program's text here (.gz: compressed)")
  ap.add_argument("--hlo", default=None, help="read a saved program's text instead of compiling (give the --pair, "
                  "--config and --layers it was compiled with: they name its attention kernels)")
  ap.add_argument("--before", default=None, help="a saved program to compare with, group by group")
  ap.add_argument("--out", default=None, help="also write the tables as this pair and setting's section of this "
                  "Markdown file (e.g. benchmarks/results/step_cycles.md)")
  ap.add_argument("--commit", default=None, help="the commit the program was compiled from (default: HEAD)")
  ap.add_argument("--before-commit", default=None, help="the commit the --before program was compiled from")
  args = ap.parse_args()
  extra: dict = {}
  s = Setting.parse(args.config)
  layers = tuple(int(n) for n in args.layers.split(",")) if args.layers else None
  if args.hlo:  # the pair, setting and layers given are the saved program's (they name its attention kernels)
    hlo = _read(args.hlo)
  else:
    hlo, seconds, extra = compile_hlo(args.pair, s, args.topology, layers)
    print(f"{args.pair} {s.label()}: compiled for one device of {args.topology} in {seconds:.0f} s", flush=True)
    if args.save_hlo:
      opener = gzip.open if args.save_hlo.endswith(".gz") else open
      with opener(args.save_hlo, "wt", encoding="utf-8") as f:
        f.write(hlo)
  extra["kernel_s"] = kernel_seconds(args.pair, s, args.topology, layers)
  text = report(hlo, args.ghz, args.top, args.grep, _read(args.before) if args.before else None, extra,
                args.topology)
  print(text)
  if args.out:
    import jax

    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    title = f"## {args.pair} {s.label()}" + (f", layers {args.layers}" if layers else "") + f" on {args.topology}"
    before = f"; before: commit {args.before_commit or '?'}" if args.before else ""
    head = (f"{title}\n\nCompiled from commit {commit}{before}; {datetime.date.today()}, jax {jax.__version__}, "
            f"libtpu {libtpu_version()}; `python benchmarks/step_cycles.py {shlex.join(sys.argv[1:])}`\n\n")
    if not os.path.exists(args.out):
      with open(args.out, "w", encoding="utf-8") as f:
        f.write("# The distillation step's estimated cycles on a TPU, compiled without one\n\nWritten by "
                "`benchmarks/step_cycles.py` (its docstring says what the tables count); one section per pair, "
                "setting and topology, replaced when written again.\n")
    replace_section(args.out, "\n" + title, head + text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
