"""The ``meshdistill`` command.

  meshdistill distill                       # the main job: configs/default.yaml on a 2x4 mesh
  meshdistill distill --config tiny --set train.steps=50 --set distill.alpha=0.7
  meshdistill pretrain [--out DIR [--overwrite]]  # pretrain (and cache) the configured teacher
  meshdistill eval RUN_DIR                  # validation loss / perplexity / agreement of a run
  meshdistill generate RUN_DIR --prompt "def "   # samples of a run's student (--model teacher: its teacher)
  meshdistill plot RUN_DIR                  # PNG curves of loss, KL, CE and correlation
  meshdistill export RUN_DIR OUT_DIR [--dtype bfloat16] [--step N] [--overwrite]   # the student as a HF checkpoint
  meshdistill export RUN_DIR OUT_DIR --adapter      # a LoRA student's adapters as a PEFT adapter directory
  meshdistill config [--config ...] [--set ...]   # print the effective configuration
  meshdistill plan --teacher llama3.1-8b --student llama3.2-1b --topology v5e:4x4 --batch 16 --seq 2048
  meshdistill launch --processes 2 -- meshdistill distill --config tiny   # N local processes, one job

``distill``, ``pretrain`` and ``eval`` join a job of several processes (one per host of a TPU pod
slice or GPU cluster) with ``--coordinator HOST:PORT --num-processes N --process-id I``, the
``MESHDISTILL_COORDINATOR`` / ``_NUM_PROCESSES`` / ``_PROCESS_ID`` variables, or ``--coordinator auto``
(JAX's cluster auto-detection, also used when a cluster launcher's variables are found); see
`meshdistill.distributed`.

``--config`` takes a YAML file or the name of a packaged config (``default``, ``tiny``);
``--set key.path=value`` (repeatable) overrides one setting, the value parsed as YAML. Bad
keys or values are reported before anything runs. On a machine without an accelerator the
mesh runs on simulated CPU devices (``mesh.simulate_cpu_devices: auto``).

Only this module prints; the library logs (``-v`` shows its INFO messages).

Exit codes: 0 done; 2 refused (a bad setting, a missing or damaged input, an output that
would replace files, a run directory in use) -- nothing was lost; 1 training failed (the
divergence guard gave up, a checkpoint could not be written) -- the last checkpoint is kept;
130 interrupted (Ctrl-C); 143 stopped by SIGTERM after writing a checkpoint. Rerunning the
same command resumes after 1, 130 and 143.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from meshdistill.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="meshdistill", description="Knowledge distillation on a JAX (data, tensor) mesh.")
  p.add_argument("-v", "--verbose", action="store_true", help="show library log messages (INFO)")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

  def with_config(sp):
    sp.add_argument("--config", default=None, help="YAML file or packaged config name (default: the built-in default)")
    sp.add_argument(
      "--set",
      dest="overrides",
      action="append",
      default=[],
      metavar="KEY=VALUE",
      help="override a setting, e.g. --set train.steps=200 (repeatable)",
    )
    return sp

  def with_processes(sp):
    g = sp.add_argument_group("several processes (one per host; see meshdistill.distributed)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address, the same on every process, or 'auto' (cluster auto-detection)")
    g.add_argument("--num-processes", default=None, type=int, metavar="N", help="processes in the job")
    g.add_argument("--process-id", default=None, type=int, metavar="I", help="this process's id, 0..N-1")
    return sp

  d = with_processes(with_config(sub.add_parser("distill", help="distil the teacher into the student (the main job)")))
  d.add_argument("--profile", default=None, metavar="START:STOP", help="write a JAX profiler trace of these steps")
  pt = with_processes(
    with_config(sub.add_parser("pretrain", help="pretrain the configured teacher from scratch and cache it"))
  )
  pt.add_argument("--out", default=None, help="teacher directory to write (default: the teacher cache)")
  pt.add_argument("--overwrite", action="store_true", help="replace an existing teacher directory at --out")
  pt.add_argument("--profile", default=None, metavar="START:STOP", help="write a JAX profiler trace of these steps")
  e = with_processes(with_config(sub.add_parser("eval", help="evaluate a distillation run's latest checkpoint")))
  e.add_argument("run_dir", nargs="?", default=None, help="run directory (default: run.run_dir of the config)")
  g = with_config(sub.add_parser("generate", help="print samples of a run's student or teacher"))
  g.add_argument("run_dir", nargs="?", default=None, help="run directory (default: run.run_dir of the config)")
  g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  g.add_argument("--prompts-file", default=None, help="a text file (one prompt a line) or JSONL with a 'prompt' field")
  g.add_argument("--model", choices=("student", "teacher"), default="student", help="which model samples")
  g.add_argument("--max-new-tokens", type=int, default=64)
  g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
  g.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
  g.add_argument("--top-p", type=float, default=1.0, help="1 = no nucleus filter")
  g.add_argument("--seed", type=int, default=0)
  pl = sub.add_parser("plot", help="write PNG curves of a run's metrics")
  pl.add_argument("run_dir", help="run directory holding metrics.jsonl")
  pl.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")
  ct = with_processes(with_config(
    sub.add_parser("cache-teacher", help="write the teacher's top-k over the training data (resumable)")
  ))
  ct.add_argument("--out", required=True, help="cache directory to write (rerun to resume; then teacher.cache=OUT)")
  ct.add_argument("--k", type=int, default=32, help="tokens kept per position (default 32)")
  ct.add_argument("--precision", default="float16", help="log-probabilities as float16 (compact) or float32 (exact)")
  ct.add_argument("--rows-per-shard", type=int, default=1024, help="packed rows per shard file")
  with_config(sub.add_parser("config", help="print the effective configuration as YAML"))
  la = sub.add_parser("launch", help="run a command as N local CPU processes of one job (development, tests)")
  la.add_argument("--processes", type=int, required=True, metavar="N", help="number of processes")
  la.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
  la.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command every process runs")
  ex = sub.add_parser("export", help="write a distillation run's student as a Hugging Face checkpoint")
  ex.add_argument("run_dir", help="run directory of a `meshdistill distill` run")
  ex.add_argument("out_dir", help="directory to write (config.json, model.safetensors, tokenizer files)")
  ex.add_argument("--dtype", default="float32", help="dtype of the written weights: float32, bfloat16 or float16")
  ex.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the latest)")
  ex.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty OUT_DIR")
  ex.add_argument("--adapter", action="store_true", help="a LoRA run: write its adapters as a PEFT adapter directory "
                  "(adapter_config.json, adapter_model.safetensors, and the base in base/) instead of merged weights")
  _plan_parser(with_config(sub.add_parser("plan", help="compile the distillation step for a TPU slice or CPU devices "
                                          "and report whether and how it fits (no accelerator needed)")))
  return p


def _plan_parser(sp) -> None:
  sp.add_argument("--teacher", default=None, help="preset name, config.json path or directory (default: the config's)")
  sp.add_argument("--student", default=None, help="preset name, config.json path or directory (default: the config's)")
  target = sp.add_mutually_exclusive_group(required=True)
  target.add_argument("--topology", default=None, help="TPU topology, e.g. v5e:4x4, v5p:4x4x4 (needs meshdistill[tpu])")
  target.add_argument("--devices", default=None, help="cpu:N: N simulated CPU devices of this machine")
  sp.add_argument("--mesh", default="auto", help="DATAxTENSOR, e.g. 2x8, or auto (default)")
  sp.add_argument("--batch", type=int, default=None, help="global batch size (default: train.batch_size)")
  sp.add_argument("--seq", type=int, default=None, help="sequence length (default: data.seq_len)")
  sp.add_argument("--dtype", default=None, help="compute dtype of both models (presets default to bfloat16)")
  sp.add_argument("--remat", default=None, help="the student's remat policy: none, dots, dots_no_batch, full")
  sp.add_argument("--chunk-size", type=int, default=None, help="chunked loss with this many tokens per chunk")
  sp.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                  help="both models' blocks under nnx.scan (one compiled body) or unrolled (default: as configured)")
  sp.add_argument("--attention", default=None, help="both models' attention kernel: auto, explicit, xla, cudnn, "
                  "splash (the Pallas TPU kernel; seq a multiple of 128) (default: as configured / auto for presets)")
  sp.add_argument("--hbm-gib", type=float, default=None, help="memory budget per device in GiB (replaces the chip's)")
  sp.add_argument("--search", action="store_true",
                  help="compile meshes x remat x chunk sizes x batches; rank those that fit")
  sp.add_argument("--batches", default=None, help="with --search: comma-separated batch sizes (default: --batch)")
  sp.add_argument("--max-compiles", type=int, default=None, help="compilations allowed for suggestions / --search")
  sp.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _plan(args) -> int:
  """``meshdistill plan``: JAX starts here on CPU devices only; TPU programs are compiled, never run."""
  import json  # pylint: disable=g-import-not-at-top

  from meshdistill.planner._hardware import cpu_count_of  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  from meshdistill.mesh import _backend_started  # pylint: disable=g-import-not-at-top

  if not os.environ.get("JAX_PLATFORMS") and not _backend_started():
    # the planner needs no accelerator: skip probing for one (jax read the environment when it was imported)
    jax.config.update("jax_platforms", "cpu")
    os.environ["JAX_PLATFORMS"] = "cpu"
  n = cpu_count_of(args.devices)
  if n is not None and n > 1:
    from meshdistill.mesh import simulate_cpu_devices  # pylint: disable=g-import-not-at-top

    simulate_cpu_devices(n)
  from meshdistill import planner  # pylint: disable=g-import-not-at-top

  common = dict(topology=args.topology, devices=args.devices, seq=args.seq, config=args.config,
                overrides=args.overrides, dtype=args.dtype, hbm_gib=args.hbm_gib, scan_layers=args.scan_layers,
                attention=args.attention)
  t0 = time.perf_counter()
  if args.search:
    batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    chunks = None if args.chunk_size is None else [args.chunk_size]
    remats = None if args.remat is None else [args.remat]
    plans = planner.search(args.teacher, args.student, batch=args.batch, batches=batches, remats=remats,
                           chunk_sizes=chunks, max_compiles=args.max_compiles or 12, **common)
    if args.json:
      print(json.dumps([p.to_dict() for p in plans], indent=1))
    else:
      print(planner.search_table(plans))
      if plans and plans[0].fits is not False:
        print(f"\nbest: {plans[0].describe()}")
  else:
    extra = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    p = planner.plan(args.teacher, args.student, mesh=args.mesh, batch=args.batch, remat=args.remat,
                     max_compiles=args.max_compiles or 4, **extra, **common)
    print(p.to_json(indent=1) if args.json else p.table())
  print(f"planned in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
  return 0


def _setup_logging(verbose: bool) -> None:
  logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "jax._src", "orbax", "etils"):
    logging.getLogger(noisy).setLevel(logging.INFO if verbose else logging.ERROR)


def _load(args, run_dir: str | None = None):
  config = args.config
  overrides = list(args.overrides)
  if run_dir is not None:
    saved = os.path.join(run_dir, "config.yaml")
    if config is None and os.path.isfile(saved):
      config = saved
    overrides.append(f"run.run_dir={run_dir}")
  return load_config(config, overrides)


def _err(msg: str, code: int = 2) -> int:
  print(f"meshdistill: error: {msg}", file=sys.stderr)
  return code


def _export(args) -> int:
  from meshdistill import export  # pylint: disable=g-import-not-at-top

  try:  # settings, run directory and OUT_DIR are checked before JAX starts
    cfg = export.run_config(args.run_dir)
    if args.dtype not in export.DTYPES:
      raise ValueError(f"--dtype={args.dtype!r}; choose one of {list(export.DTYPES)}")
    export.check_out_dir(args.out_dir, args.overwrite, args.adapter)
    from meshdistill import jobs  # pylint: disable=g-import-not-at-top

    jobs.prepare_devices(cfg)
    out = export.export_run(
      args.run_dir, args.out_dir, dtype=args.dtype, step=args.step, overwrite=args.overwrite, cfg=cfg,
      adapter=args.adapter,
    )
  except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
    return _err(str(e))
  except RuntimeError as e:  # meshdistill.checkpoint.CheckpointError: no intact checkpoint
    return _err(str(e), code=1)
  print(f"exported step {out['step']} of {args.run_dir} ({out['family']}, {out['params']:,} params, {out['dtype']}) "
        f"-> {out['out_dir']}")
  print(f"tokenizer: {out['tokenizer']}")
  if "base" in out:
    print(f"adapters apply to the base {out['base']}")
  return 0


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  _setup_logging(args.verbose)
  if args.command == "launch":
    from meshdistill import distributed  # pylint: disable=g-import-not-at-top

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
      return distributed.launch(args.processes, cmd, port=args.port)
    except distributed.DistributedError as e:
      return _err(str(e))
  if args.command == "plot":
    from meshdistill.monitor import plot_run  # pylint: disable=g-import-not-at-top

    try:
      for path in plot_run(args.run_dir, args.out):
        print(path)
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as e:
      return _err(str(e))
    return 0

  if args.command == "export":
    return _export(args)

  run_dir = getattr(args, "run_dir", None)
  if run_dir is not None and not os.path.isdir(run_dir):
    return _err(f"run directory {run_dir} does not exist; give the run.run_dir of a `meshdistill distill` run")
  try:  # every setting is checked here, before JAX starts or any data is read
    cfg = _load(args, run_dir)
    if args.command == "pretrain" and args.out is not None:
      from meshdistill.checkpoint import check_teacher_target  # pylint: disable=g-import-not-at-top

      check_teacher_target(args.out, overwrite=args.overwrite)  # again before saving; here to fail fast
  except (ConfigError, FileNotFoundError, FileExistsError) as e:
    return _err(str(e))
  if args.command == "plan":
    try:
      return _plan(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
      return _err(str(e))
  if args.command == "config":
    import yaml  # pylint: disable=g-import-not-at-top

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0

  from meshdistill import jobs  # pylint: disable=g-import-not-at-top
  from meshdistill.fsutil import RunLockedError  # pylint: disable=g-import-not-at-top
  from meshdistill.monitor import ProfileWindow  # pylint: disable=g-import-not-at-top
  from meshdistill.stopping import Stopped, stop_on_signals  # pylint: disable=g-import-not-at-top

  try:
    ProfileWindow.parse(getattr(args, "profile", None), "")
  except ValueError as e:
    return _err(str(e))

  from meshdistill import distributed  # pylint: disable=g-import-not-at-top

  try:  # before JAX starts a backend
    # (`generate` runs as one process: it takes no process flags)
    process_flags = (getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id"))
    distributed.initialize(distributed.resolve(*process_flags))
    jobs.prepare_devices(cfg)
  except distributed.DistributedError as e:
    return _err(str(e))
  t0 = time.perf_counter()
  with stop_on_signals():  # SIGTERM: checkpoint, then exit 143
    try:
      if args.command == "pretrain":
        out = jobs.pretrain(cfg, out=args.out, stream=sys.stderr, profile=args.profile, overwrite=args.overwrite)
        ev = out["eval"]
        print(f"teacher ({out['params']:,} params) -> {out['teacher_dir']}")
        if ev:
          print(f"validation loss {ev['loss']:.4f}, perplexity {ev['ppl']:.3f}")
      elif args.command == "distill":
        import jax  # pylint: disable=g-import-not-at-top

        from meshdistill.layout import layout_class  # pylint: disable=g-import-not-at-top

        mesh = layout_class(cfg.mesh.backend).describe(cfg.mesh.data, cfg.mesh.tensor)
        if cfg.mesh.fsdp:
          mesh += ", fsdp"
        if cfg.mesh.student_split == "batch" and cfg.mesh.tensor > 1:
          mesh += ", student replicated on rows split over data x tensor"
        print(
          f"meshdistill distill: mesh {mesh} on {jax.device_count()} {jax.default_backend()} device(s)"
          + (f" in {jax.process_count()} processes (this is process {jax.process_index()})"
             if jax.process_count() > 1 else "")
          + f", run dir {cfg.run.run_dir}",
          file=sys.stderr,
        )
        summary = jobs.distill(cfg, stream=sys.stderr, profile=args.profile)
        print(jobs.summary_table(summary))
      elif args.command == "cache-teacher":
        from meshdistill.teacher_cache import TeacherCache  # pylint: disable=g-import-not-at-top

        m = jobs.cache_teacher(cfg, args.out, k=args.k, precision=args.precision,
                               rows_per_shard=args.rows_per_shard, stream=sys.stderr)
        if m:
          cache = TeacherCache(args.out)
          print(f"teacher cache {cache.path}: {m['rows']} rows x {m['seq_len']} tokens, top-{m['k']} at temperature "
                f"{m['temperature']}, {m['precision']}, {cache.bytes_per_token():.1f} bytes/token, "
                f"content {m['content_sha256'][:16]}")
          print(f"distil from it with: --set teacher.cache={cache.path} --set distill.top_k={m['k']}")
      elif args.command == "eval":
        print(jobs.summary_table(jobs.evaluate(cfg, stream=sys.stderr)))
      elif args.command == "generate":
        from meshdistill.generate import SamplingConfig  # pylint: disable=g-import-not-at-top
        from meshdistill.prompts import read_prompts  # pylint: disable=g-import-not-at-top

        prompts = list(args.prompt)
        if args.prompts_file:
          prompts += [r["prompt"] for r in read_prompts(args.prompts_file)]
        sampling = SamplingConfig(
          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p
        )
        texts = jobs.generate(cfg, prompts, model=args.model, sampling=sampling, seed=args.seed, stream=sys.stderr)
        for prompt, text in zip(prompts, texts):
          print(f"--- {prompt!r}\n{prompt}{text}")
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError, RunLockedError) as e:
      return _err(str(e))
    except Stopped as e:
      print(f"{e}; rerun the same command to resume", file=sys.stderr)
      return 143
    except KeyboardInterrupt:
      print("\ninterrupted; rerun the same command to resume from the last checkpoint", file=sys.stderr)
      return 130
    except RuntimeError as e:
      import jax  # pylint: disable=g-import-not-at-top

      if distributed.process_count() > 1 and isinstance(e, jax.errors.JaxRuntimeError):
        print(
          f"meshdistill: error: process {distributed.process_index()} of {distributed.process_count()}: {e}\n"
          "a collective between the processes failed (did another process of the job stop?); rerun the same command "
          "on every process to resume (from the last checkpoint, or for cache-teacher from the shards written)",
          file=sys.stderr,
        )
        return 1
      return _err(str(e), code=1)  # the guard gave up, no intact checkpoint (CheckpointError): last checkpoint kept
    except OSError as e:  # a checkpoint or output that could not be written (a full disk)
      return _err(str(e), code=1)
  print(f"done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
