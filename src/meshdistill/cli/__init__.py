"""The ``meshdistill`` command.

  meshdistill distill                       # the main job: configs/default.yaml on a 2x4 mesh
  meshdistill distill --config tiny --set train.steps=50 --set distill.alpha=0.7
  meshdistill pretrain [--out DIR [--overwrite]]  # pretrain (and cache) the configured teacher
  meshdistill eval RUN_DIR                  # validation loss / perplexity / agreement of a run
  meshdistill generate RUN_DIR --prompt "def "   # samples of a run's student (--model teacher: its teacher)
  meshdistill plot RUN_DIR                  # PNG curves of loss, KL, CE and correlation
  meshdistill export RUN_DIR OUT_DIR [--dtype bfloat16] [--step N] [--overwrite]   # the student as a HF checkpoint
  meshdistill export RUN_DIR OUT_DIR --adapter      # a LoRA student's adapters as a PEFT adapter directory
  meshdistill export RUN_DIR OUT_DIR --quantized    # a quantization-aware student, compressed-tensors format
  meshdistill config [--config ...] [--set ...]   # print the effective configuration
  meshdistill prune --out DIR --mlp 256 --heads 4 --embed 128 --layers 2   # a student cut from the teacher
  meshdistill plan --teacher llama3.1-8b --student llama3.2-1b --topology v5e:4x4 --batch 16 --seq 2048
  meshdistill launch --processes 2 -- meshdistill distill --config tiny   # N local processes, one job
  meshdistill serve-teacher --config tiny --port 8000 --k 32   # the teacher's top-k over HTTP (teacher.source: remote)

``distill``, ``pretrain`` and ``eval`` join a job of several processes (one per host of a TPU pod
slice or GPU cluster) with ``--coordinator HOST:PORT --num-processes N --process-id I``, the
``MESHDISTILL_COORDINATOR`` / ``_NUM_PROCESSES`` / ``_PROCESS_ID`` variables, or ``--coordinator auto``
(JAX's cluster auto-detection, also used when a cluster launcher's variables are found); see
`meshdistill.parallel.distributed`.

``--config`` takes a YAML file or the name of a packaged config (``default``, ``tiny``);
``--set key.path=value`` (repeatable) overrides one setting, the value parsed as YAML. Bad
keys or values are reported before anything runs. On a machine without an accelerator the
mesh runs on simulated CPU devices (``mesh.simulate_cpu_devices: auto``), and JAX does not probe
for a TPU (``JAX_PLATFORMS=cpu`` unless set; see `meshdistill.parallel.distributed.platforms`).

Only this module prints; the library logs (``-v``, before or after the command, shows its INFO
messages; ``plan`` shows its progress without it). Job modules (JAX, the data pipeline) are imported
inside the chosen command, so ``--help`` and ``--version`` answer at once.

Exit codes: 0 done; 2 refused (a bad setting, a missing or damaged input, an output that
would replace files, a run directory in use, a served teacher that refused the request (4xx) or tells
an identity a client cannot read, a ``serve-teacher`` flag or port that cannot work) -- nothing was
lost; 1 training failed (the divergence guard gave up, a checkpoint could not be written, a served
teacher that stayed down or kept answering unusably) -- the last checkpoint is kept;
143 stopped by SIGTERM and 130 stopped by SIGINT (Ctrl-C): ``distill`` and ``pretrain`` after
writing a checkpoint of the step in flight, ``cache-teacher`` after recording the shard in flight
(`meshdistill.train.loop.stopping`); a second signal ends the process at once. Rerunning the same command
resumes after 1, 130 and 143. ``launch`` forwards SIGTERM and SIGINT to its processes and exits
with the first failing process's code (128 + N for one ended by signal N).
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import time

from meshdistill.cli.parser import parser as _parser
from meshdistill.core.typed_yaml import ConfigError  # light (no JAX): job modules are imported inside each command

# commands whose loops honour a stop request (`meshdistill.train.loop.stopping`): SIGTERM / SIGINT end them at a step or
# shard boundary with their progress saved (exit 143 / 130)
STOPPABLE = ("distill", "pretrain", "cache-teacher")


def _plan(args) -> int:
  """``meshdistill plan``: JAX starts here on CPU devices only; TPU programs are compiled, never run."""
  import json  # pylint: disable=g-import-not-at-top

  from meshdistill.planner import cpu_count_of  # lazy: the planner, for plan only

  n = cpu_count_of(args.devices)
  if n is not None and n > 1:
    from meshdistill.parallel.mesh import simulate_cpu_devices  # lazy: JAX

    simulate_cpu_devices(n)
  from meshdistill import planner  # lazy: the planner, for plan only

  common = dict(topology=args.topology, devices=args.devices, seq=args.seq, config=args.config,
                overrides=args.overrides, dtype=args.dtype, hbm_gib=args.hbm_gib, scan_layers=args.scan_layers,
                attention=args.attention, fast_compile=args.fast_compile)
  t0 = time.perf_counter()
  allowed = args.max_compiles  # None: the default of each mode; 0 compiles no suggestion
  if args.search:
    batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    chunks = None if args.chunk_size is None else [args.chunk_size]
    remats = None if args.remat is None else [args.remat]
    plans = planner.search(args.teacher, args.student, batch=args.batch, batches=batches, remats=remats,
                           chunk_sizes=chunks, max_compiles=12 if allowed is None else allowed, **common)
    if args.json:
      print(json.dumps([p.to_dict() for p in plans], indent=1))
    else:
      print(planner.search_table(plans))
      if plans and plans[0].fits is not False:
        print(f"\nbest: {plans[0].describe()}")
  else:
    extra = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    p = planner.plan(args.teacher, args.student, mesh=args.mesh, batch=args.batch, remat=args.remat,
                     max_compiles=4 if allowed is None else allowed, placement=args.placement, **extra, **common)
    print(p.to_json(indent=1) if args.json else p.table())
  print(f"planned in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
  return 0


def _setup_logging(verbose: bool, command: str | None = None) -> None:
  logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "jax._src", "orbax", "etils"):
    logging.getLogger(noisy).setLevel(logging.INFO if verbose else logging.ERROR)
  if command == "plan":  # compilations take minutes on large pairs: show what is being compiled, and for how long
    logging.getLogger("meshdistill.planner").setLevel(logging.INFO)


def _load(args, run_dir: str | None = None):
  config = args.config
  overrides = list(args.overrides)
  if run_dir is not None:
    saved = os.path.join(run_dir, "config.yaml")
    if config is None and os.path.isfile(saved):
      config = saved
    overrides.append(f"run.run_dir={run_dir}")
  from meshdistill.config import load_config  # lazy: the config's sections load JAX

  return load_config(config, overrides)


def _next_steps(run_dir: str) -> str:
  """Where a finished ``distill`` run's outputs are and the commands that read them."""
  import json  # pylint: disable=g-import-not-at-top
  import shlex  # pylint: disable=g-import-not-at-top

  here = shlex.quote(run_dir)
  kept = [label for name, label in (("checkpoints", "checkpoints/"), ("metrics.jsonl", "metrics.jsonl"),
                                    ("tb", "tb/ (TensorBoard)"), ("summary.json", "summary.json"),
                                    ("config.yaml", "config.yaml")) if os.path.exists(os.path.join(run_dir, name))]
  steps = [(f"meshdistill eval {here}", "validation loss, perplexity, agreement"),
           (f"meshdistill plot {here}", "PNG curves of the losses"),
           (f"meshdistill export {here} OUT_DIR", "the student as a Hugging Face checkpoint")]
  width = max(len(c) for c, _ in steps)
  return "\n".join([f"outputs in {run_dir}: {', '.join(kept)}", "next:",
                    *(f"  {c.ljust(width)}  # {w}" for c, w in steps),
                    f"  python: student, config, step = md.load_run({json.dumps(run_dir)})"])


def _serve_settings(args, settings_class):
  """``serve-teacher``'s flags as `ServeSettings` (each checked, `ConfigError` naming the flag), the token from
  ``--token-file`` (owner-only), ``--token`` (with a warning: the process list shows it) or the environment."""
  if args.token is not None and args.token_file is not None:
    raise ConfigError("--token and --token-file both give the bearer token; keep --token-file")
  token = args.token
  if args.token is not None:
    print("meshdistill: warning: --token puts the secret in the process list (ps, /proc/PID/cmdline) of every local "
          "user; use --token-file PATH (chmod 600) or $MESHDISTILL_TEACHER_TOKEN", file=sys.stderr)
  elif args.token_file is not None:
    token = read_token_file(args.token_file)
  else:
    token = os.environ.get("MESHDISTILL_TEACHER_TOKEN") or None
  lengths = None
  if args.lengths:
    try:
      lengths = tuple(int(v) for v in args.lengths.split(","))
    except ValueError:
      raise ConfigError(f"--lengths {args.lengths!r} must be comma-separated integers >= 1, e.g. 64,128") from None
  return settings_class(
      host=args.host, port=args.port, k=args.k, token=token, max_rows=args.max_rows, max_wait_ms=args.max_wait_ms,
      lengths=lengths, max_tokens=args.max_tokens, max_bytes=args.max_bytes, graceful_s=args.graceful_s,
      max_connections=args.max_connections, read_timeout_s=args.read_timeout_s,
      insecure_no_token=args.insecure_no_token, served_name=args.served_name, hold_file=args.hold_file)


def read_token_file(path: str) -> str:
  """The token in ``path`` (surrounding whitespace stripped); `ConfigError` when the file is missing, not a regular
  file (a FIFO would wait for a writer for ever, a directory has no token), empty, or readable or writable by anyone
  but its owner (as ssh refuses such a key)."""
  try:  # non-blocking: opening a FIFO returns at once (and is refused below) instead of waiting for a writer
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
  except OSError as e:
    raise ConfigError(f"--token-file {path}: cannot read it ({e.strerror})") from None
  mode = os.fstat(fd).st_mode
  if not stat.S_ISREG(mode):
    os.close(fd)
    kind = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket",
            stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}.get(stat.S_IFMT(mode), "not a file")
    raise ConfigError(f"--token-file {path} is {kind}; give a regular file holding the token (e.g. openssl rand "
                      f"-hex 16 > {path}, chmod 600)")
  with os.fdopen(fd, "rb") as raw:
    if mode & 0o077:
      raise ConfigError(f"--token-file {path} has mode {mode & 0o777:o}: others may read or change the token; "
                        f"chmod 600 {path}")
    token = raw.read().decode("utf-8", errors="replace").strip()
  if not token:
    raise ConfigError(f"--token-file {path} is empty; write the token in it (e.g. openssl rand -hex 16 > {path})")
  return token


def _err(msg: str, code: int = 2) -> int:
  print(f"meshdistill: error: {msg}", file=sys.stderr)
  return code


def _export(args) -> int:
  from meshdistill.jobs import export  # lazy: JAX
  from meshdistill.config import run_config  # lazy: the config's sections load JAX

  try:  # settings, run directory and OUT_DIR are checked before JAX starts
    cfg = run_config(args.run_dir)
    if args.dtype not in export.DTYPES:
      raise ValueError(f"--dtype={args.dtype!r}; choose one of {list(export.DTYPES)}")
    if args.quantized:
      export.check_quantized(cfg, args.run_dir, args.adapter)
    export.check_out_dir(args.out_dir, args.overwrite, args.adapter)
    from meshdistill import jobs  # lazy: JAX

    cfg = jobs.prepare_devices(cfg)
    out = export.export_run(
      args.run_dir, args.out_dir, dtype=args.dtype, step=args.step, overwrite=args.overwrite, cfg=cfg,
      adapter=args.adapter, quantized=args.quantized,
    )
  except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
    return _err(str(e))
  except RuntimeError as e:  # meshdistill.storage.checkpoint.CheckpointError: no intact checkpoint
    return _err(str(e), code=1)
  print(f"exported step {out['step']} of {args.run_dir} ({out['family']}, {out['params']:,} params, {out['dtype']}) "
        f"-> {out['out_dir']}")
  print(f"tokenizer: {out['tokenizer']}")
  if "base" in out:
    print(f"adapters apply to the base {out['base']}")
  if "quantization" in out:
    print(f"quantized: {out['quantization']}")
  return 0


def main(argv: list[str] | None = None) -> int:
  try:
    return _main(argv)
  except KeyboardInterrupt:  # Ctrl-C where no stop request is installed (plan, export, start-up): nothing to save
    print("\ninterrupted", file=sys.stderr)
    return 130


def _main(argv: list[str] | None) -> int:
  args = _parser().parse_args(argv)
  _setup_logging(args.verbose, args.command)
  if args.command != "launch":  # the launcher starts no JAX; its processes get JAX_PLATFORMS=cpu from it
    from meshdistill.parallel.distributed.platforms import select_platform  # lazy: --help loads the parser only

    # `plan` compiles for a topology from the host's CPU, except `--devices local`: the chips of this machine
    local = str(getattr(args, "devices", None) or "").strip().lower() in ("local", "tpu")
    select_platform(force_cpu=args.command == "plan" and not local)  # CPU unless an accelerator is present
  if args.command == "launch":
    from meshdistill.parallel import distributed  # lazy: --help loads the parser only

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
      return distributed.launch(args.processes, cmd, port=args.port)
    except distributed.DistributedError as e:
      return _err(str(e))
  if args.command == "plot":
    from meshdistill.train.loop.monitor import plot_run  # lazy: JAX

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
      from meshdistill.teachers.checkpoint import check_teacher_target  # lazy: JAX, orbax

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

  from meshdistill import jobs  # lazy: JAX
  from meshdistill.core.fsutil import RunLockedError  # lazy: --help loads the parser only
  from meshdistill.train.loop.monitor import ProfileWindow  # lazy: JAX
  from meshdistill.train.loop.stopping import STOP_SIGNALS, Stopped, stop_on_signals  # lazy: --help loads the parser only

  try:
    ProfileWindow.parse(getattr(args, "profile", None), "")
  except ValueError as e:
    return _err(str(e))

  from meshdistill.parallel import distributed  # lazy: --help loads the parser only

  try:  # before JAX starts a backend
    # (`generate` runs as one process: it takes no process flags)
    process_flags = (getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id"))
    distributed.initialize(distributed.resolve(*process_flags))
    cfg = jobs.prepare_devices(cfg)
  except distributed.DistributedError as e:
    return _err(str(e))
  t0 = time.perf_counter()
  # SIGTERM / SIGINT: finish the step (shard), save it, exit 143 / 130; eval and generate keep the default actions
  with stop_on_signals(STOP_SIGNALS if args.command in STOPPABLE else ()):
    try:
      if args.command == "pretrain":
        out = jobs.pretrain(cfg, out=args.out, stream=sys.stderr, profile=args.profile, overwrite=args.overwrite)
        ev = out["eval"]
        print(f"teacher ({out['params']:,} params) -> {out['teacher_dir']}")
        if ev:
          print(f"validation loss {ev['loss']:.4f}, perplexity {ev['ppl']:.3f}")
      elif args.command == "prune":
        targets = jobs.PruneTargets(mlp=args.mlp, heads=args.heads, embed=args.embed, layers=args.layers,
                                    depth=args.depth)
        r = jobs.prune(cfg, args.out, targets, batches=args.batches, overwrite=args.overwrite, stream=sys.stderr)
        t, s = r["teacher"], r["student"]
        for who, m in (("teacher", t), ("student", s)):
          print(f"{who}: {m['params']:,} params, d_model {m['d_model']}, {m['n_layers']} blocks, {m['n_heads']} heads "
                f"({m['n_kv_heads']} key/value), mlp {m['mlp_hidden']}")
        print(f"kept {100 * r['fraction_kept']:.1f}% of the parameters; removed blocks {r['removed']['layers']}")
        print(f"student -> {r['out']}/student (distil it with --set student.init.pruned={r['out']}), "
              f"Hugging Face export -> {r['out']}/hf")
      elif args.command == "distill":
        from meshdistill.parallel.backends import layout_class  # lazy: JAX

        layout = layout_class(cfg.mesh.backend).describe(cfg.mesh.data, cfg.mesh.tensor)
        if cfg.mesh.fsdp:
          layout += ", fsdp"
        if cfg.mesh.student_split == "batch" and cfg.mesh.tensor > 1:
          layout += ", student replicated on rows split over data x tensor"
        # the devices, processes and mesh follow in the job's own "devices:" line
        print(f"meshdistill distill: layout {layout}, run dir {cfg.run.run_dir}", file=sys.stderr)
        summary = jobs.distill(cfg, stream=sys.stderr, profile=args.profile)
        print(jobs.summary_table(summary))
        print(_next_steps(cfg.run.run_dir))
      elif args.command == "cache-teacher":
        from meshdistill.teachers.cache import TeacherCache  # lazy: JAX

        m = jobs.cache_teacher(cfg, args.out, k=args.k, precision=args.precision,
                               rows_per_shard=args.rows_per_shard, stream=sys.stderr, teacher=args.teacher)
        if m:
          cache = TeacherCache(args.out)
          print(f"teacher cache {cache.path}: {m['rows']} rows x {m['seq_len']} tokens, top-{m['k']} at temperature "
                f"{m['temperature']}, {m['precision']}, {cache.bytes_per_token():.1f} bytes/token, "
                f"content {m['content_sha256'][:16]}")
          if cache.cross:  # rows of the teacher's tokens: any student tokenizer, a cross-tokenizer strategy
            print(f"a cross-tokenizer cache of teacher tokenizer {cache.teacher_tokenizer['setting']!r}: distil from it "
                  f"with: --set teacher.cache={cache.path} (data.teacher_tokenizer as now, distill.kind byte_kl, "
                  "span_kl or uld; any data.tokenizer for the student)")
          else:
            print(f"distil from it with: --set teacher.cache={cache.path} --set distill.top_k={m['k']}")
      elif args.command == "serve-teacher":
        stats = jobs.serve_teacher(cfg, _serve_settings(args, jobs.ServeSettings), stream=sys.stderr)
        print(f"teacher server stopped: {stats['requests']} requests in {stats['calls']} teacher calls, "
              f"{stats['tokens']} tokens")
      elif args.command == "eval" and args.task:
        r = jobs.evaluate_task(cfg, args.task, model=args.model, prompts=args.prompts, samples=args.samples,
                               temperature=args.temperature, seed=args.seed, stream=sys.stderr)
        print(f"task {r['task']} ({r['prompts']} held-out problems, {r['model']}): greedy accuracy {r['greedy']:.4f}"
              + "".join(f", {k} {r[k]:.4f}" for k in r if k == "sampled" or k.startswith("pass@")))
      elif args.command == "eval":
        print(jobs.summary_table(jobs.evaluate(cfg, stream=sys.stderr)))
      elif args.command == "generate":
        from meshdistill.models.generate import SamplingConfig  # lazy: JAX
        from meshdistill.data.chat import read_chat_prompts  # lazy: JAX

        prompts = list(args.prompt)
        if args.prompts_file:  # strings, or conversations (JSONL `messages`) rendered with the chat template
          prompts += read_chat_prompts(args.prompts_file)
        sampling = SamplingConfig(
          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p
        )
        gen = dict(model=args.model, sampling=sampling, seed=args.seed, stream=sys.stderr)
        if args.out:  # training records: conversations with the reply as the assistant's turn, or prompt/completion
          records = jobs.generate_records(cfg, prompts, out=args.out, **gen)
          done = sum(r["finished"] for r in records)
          print(f"wrote {len(records)} records to {args.out} ({done} ended before --max-new-tokens; train on them "
                f"with --set data.source={args.out})")
        else:
          for prompt, text in zip(prompts, jobs.generate(cfg, prompts, **gen)):
            print(f"--- {prompt!r}\n{prompt}{text}" if isinstance(prompt, str) else f"--- {prompt!r}\n{text}")
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError, RunLockedError) as e:
      return _err(str(e))
    except Stopped as e:
      print(f"{e}; rerun the same command to resume", file=sys.stderr)
      return e.exit_code
    except KeyboardInterrupt:  # eval, generate (the stoppable commands turn SIGINT into a stop request)
      print("\ninterrupted; rerun the same command to start again", file=sys.stderr)
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
      if getattr(e, "exit_code", None) in (1, 2):  # a served teacher: 2 refused the request, 1 failed (a rerun resumes)
        return _err(str(e), code=e.exit_code)
      return _err(str(e), code=1)  # the guard gave up, no intact checkpoint (CheckpointError): last checkpoint kept
    except OSError as e:  # a checkpoint or output that could not be written (a full disk)
      return _err(str(e), code=1)
  print(f"done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
