"""The ``meshdistill`` command line: its parser (every command's flags, with their defaults in ``--help``).

Part of `meshdistill.cli`; imports nothing heavy, so ``meshdistill --help`` starts at once.
"""

from __future__ import annotations

import argparse

from meshdistill import __version__


class _HelpFormatter(argparse.HelpFormatter):
  """Adds ``(default: X)`` to a flag's help unless it says its default itself or has none worth showing."""

  def _get_help_string(self, action):
    text = action.help or ""
    d = action.default
    if ("default" in text or not action.option_strings or d is None or d is False or d == []
        or d is argparse.SUPPRESS or isinstance(action, argparse._VersionAction)):  # pylint: disable=protected-access
      return text
    return f"{text} (default: %(default)s)".lstrip()


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="meshdistill", description="Knowledge distillation on a JAX (data, tensor) mesh.",
                              formatter_class=_HelpFormatter)
  p.add_argument("-v", "--verbose", action="store_true", help="show library log messages (INFO)")
  p.add_argument("--version", action="version", version=f"meshdistill {__version__}")
  # -v after the command too (`meshdistill distill -v`); SUPPRESS keeps the one given before it
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                      help="show library log messages (INFO)")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

  def command(name: str, **kw) -> argparse.ArgumentParser:
    return sub.add_parser(name, parents=[common], formatter_class=_HelpFormatter, **kw)

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
    g = sp.add_argument_group("several processes (one per host; see meshdistill.parallel.distributed)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address, the same on every process, or 'auto' (cluster auto-detection)")
    g.add_argument("--num-processes", default=None, type=int, metavar="N", help="processes in the job")
    g.add_argument("--process-id", default=None, type=int, metavar="I", help="this process's id, 0..N-1")
    return sp

  d = with_processes(with_config(command("distill", help="distil the teacher into the student (the main job)")))
  d.add_argument("--profile", default=None, metavar="START:STOP", help="write a JAX profiler trace of these steps")
  pt = with_processes(
    with_config(command("pretrain", help="pretrain the configured teacher from scratch and cache it"))
  )
  pt.add_argument("--out", default=None, help="teacher directory to write (default: the teacher cache)")
  pt.add_argument("--overwrite", action="store_true", help="replace an existing teacher directory at --out")
  pt.add_argument("--profile", default=None, metavar="START:STOP", help="write a JAX profiler trace of these steps")
  e = with_processes(with_config(command("eval", help="evaluate a distillation run's latest checkpoint")))
  e.add_argument("run_dir", nargs="?", default=None, help="run directory (default: run.run_dir of the config)")
  e.add_argument("--task", default=None, metavar="NAME",
                 help="accuracy by generation on a task with checkable answers instead (add<digits>, mul<digits>)")
  e.add_argument("--prompts", type=int, default=256, help="--task: held-out problems scored")
  e.add_argument("--samples", type=int, default=0, help="--task: samples per problem for sampled accuracy and pass@k")
  e.add_argument("--temperature", type=float, default=1.0, help="--task: sampling temperature of the samples")
  e.add_argument("--model", choices=("student", "teacher"), default="student", help="--task: which model answers")
  e.add_argument("--seed", type=int, default=0, help="--task: sampling seed")
  g = with_config(command("generate", help="print samples of a run's student or teacher"))
  g.add_argument("run_dir", nargs="?", default=None, help="run directory (default: run.run_dir of the config)")
  g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  g.add_argument("--prompts-file", default=None, help="a text file (one prompt a line) or JSONL with a 'prompt' field, "
                 "or 'messages': conversations rendered with the chat template of data.tokenizer (docs/chat.md)")
  g.add_argument("--model", choices=("student", "teacher"), default="student", help="which model samples")
  g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to sample after each prompt")
  g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
  g.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
  g.add_argument("--top-p", type=float, default=1.0, help="1 = no nucleus filter")
  g.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same samples)")
  g.add_argument("--out", default=None, help="write the completions as training records to this JSONL (conversations "
                 "with the reply as the assistant's turn, or prompt/completion pairs) instead of printing them")
  pl = command("plot", help="write PNG curves of a run's metrics")
  pl.add_argument("run_dir", help="run directory holding metrics.jsonl")
  pl.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")
  ct = with_processes(with_config(
    command("cache-teacher", help="write the teacher's top-k over the training data (resumable)")
  ))
  ct.add_argument("--out", required=True, help="cache directory to write (rerun to resume; then teacher.cache=OUT)")
  ct.add_argument("--k", type=int, default=32, help="tokens kept per position")
  ct.add_argument("--precision", default="float16", help="log-probabilities as float16 (compact) or float32 (exact)")
  ct.add_argument("--rows-per-shard", type=int, default=1024, help="packed rows per shard file")
  ct.add_argument("--teacher", default=None, metavar="NAME", help="with several teachers (teachers.sources): the one "
                  "whose cache to write (then list it as source: cache, cache: OUT)")
  _serve_parser(with_config(command("serve-teacher", help="serve the teacher's top-k over HTTP (vLLM /v1/completions "
                                    "subset) to students elsewhere (teacher.source: remote)")))
  with_config(command("config", help="print the effective configuration as YAML"))
  la = command("launch", help="run a command as N local CPU processes of one job (development, tests)")
  la.add_argument("--processes", type=int, required=True, metavar="N", help="number of processes")
  la.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
  la.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command every process runs")
  ex = command("export", help="write a distillation run's student as a Hugging Face checkpoint")
  ex.add_argument("run_dir", help="run directory of a `meshdistill distill` run")
  ex.add_argument("out_dir", help="directory to write (config.json, model.safetensors, tokenizer files)")
  ex.add_argument("--dtype", default="float32", help="dtype of the written weights: float32, bfloat16 or float16")
  ex.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the latest)")
  ex.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty OUT_DIR")
  ex.add_argument("--adapter", action="store_true", help="a LoRA run: write its adapters as a PEFT adapter directory "
                  "(adapter_config.json, adapter_model.safetensors, and the base in base/) instead of merged weights")
  ex.add_argument("--quantized", action="store_true", help="a quantization-aware run (student.quantize_aware: int8, "
                  "int4 or fp8): write its quantized weights and scales in the compressed-tensors format "
                  "(config.json's quantization_config, model.safetensors: what vLLM and transformers load; the "
                  "compress extra; docs/compress.md) instead of the dequantized float weights")
  _prune_parser(with_config(command("prune", help="score the teacher's units on the run's data and write a "
                                    "smaller student cut from it (Minitron width / depth pruning)")))
  _plan_parser(with_config(command("plan", help="compile the distillation step for a TPU slice or CPU devices "
                                          "and report whether and how it fits (no accelerator needed)")))
  return p


def _serve_parser(sp) -> None:
  sp.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface; an address other "
                  "machines reach needs a token, or --insecure-no-token)")
  sp.add_argument("--port", type=int, default=8000, help="port to listen on")
  sp.add_argument("--k", type=int, default=32, help="the most top-k log-probabilities a request may ask for")
  sp.add_argument("--token-file", default=None, metavar="PATH", help="file holding the bearer token clients must "
                  "send (readable by its owner only, like an ssh key: chmod 600)")
  sp.add_argument("--token", default=None, help="bearer token clients must send; on the command line every local user "
                  "sees it (ps): prefer --token-file or $MESHDISTILL_TEACHER_TOKEN (none of them: no token checked)")
  sp.add_argument("--insecure-no-token", action="store_true", help="serve a --host other machines reach without a "
                  "bearer token: anyone who reaches it is answered")
  sp.add_argument("--max-rows", type=int, default=64, help="prompts per teacher call (and per request) at most "
                  "(up to 4096)")
  sp.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a request waits for others to batch with")
  sp.add_argument("--lengths", default=None, help="comma-separated padded lengths the program compiles for "
                  "(default: powers of two from 64 up to the config's data.seq_len, at most the teacher's max_len)")
  sp.add_argument("--max-tokens", type=int, default=1 << 20, help="token ids per request at most")
  sp.add_argument("--max-bytes", type=int, default=64 << 20, help="request body bytes at most (also bounded by "
                  "what --max-rows prompts of the longest row take as JSON)")
  sp.add_argument("--max-connections", type=int, default=256, help="open connections at most (beyond: the idle ones "
                  "are closed first)")
  sp.add_argument("--read-timeout-s", type=float, default=30.0, help="seconds a client has to send a request's head, "
                  "and again its body")
  sp.add_argument("--graceful-s", type=float, default=30.0, help="on SIGTERM, seconds to finish requests in flight")
  sp.add_argument("--served-name", default="meshdistill-teacher", help="the model name /v1/models reports")
  # testing only: while this file exists a teacher call waits before it runs (a request provably in flight)
  sp.add_argument("--hold-file", default=None, help=argparse.SUPPRESS)


def _prune_parser(sp) -> None:
  sp.add_argument("--out", required=True, help="directory to write: student/ (then student.init.pruned=OUT), hf/, "
                  "scores.npz, report.json")
  sp.add_argument("--mlp", type=int, default=None, help="MLP hidden units kept per block (default: all)")
  sp.add_argument("--heads", type=int, default=None, help="query heads kept per block, whole query groups (default: "
                  "all)")
  sp.add_argument("--embed", type=int, default=None, help="embedding channels (d_model) kept (default: all)")
  sp.add_argument("--layers", type=int, default=None, help="blocks kept (default: all)")
  sp.add_argument("--depth", default="loss", help="how blocks are ranked: loss (loss rise when skipped) or cosine "
                  "(1 - cos of a block's input and output)")
  sp.add_argument("--batches", type=int, default=8, help="calibration batches of train.batch_size rows")
  sp.add_argument("--overwrite", action="store_true", help="replace an OUT an earlier meshdistill prune wrote")


def _plan_parser(sp) -> None:
  sp.add_argument("--teacher", default=None, help="preset name, config.json path or directory (default: the config's)")
  sp.add_argument("--student", default=None, help="preset name, config.json path or directory (default: the config's)")
  target = sp.add_mutually_exclusive_group(required=True)
  target.add_argument("--topology", default=None, help="TPU topology, e.g. v5e:1x1 (one chip), v5e:4x4, v5p:4x4x4 (needs meshdistill[tpu])")
  target.add_argument("--devices", default=None, help="cpu:N: N simulated CPU devices of this machine; local: the TPU chips of this machine")
  sp.add_argument("--mesh", default="auto", help="DATAxTENSOR, e.g. 2x8; every axis by name, e.g. "
                  "data=2,expert=2,tensor=2; or auto")
  sp.add_argument("--batch", type=int, default=None, help="global batch size (default: train.batch_size)")
  sp.add_argument("--seq", type=int, default=None, help="sequence length (default: data.seq_len)")
  sp.add_argument("--dtype", default=None, help="compute dtype of both models (presets default to bfloat16)")
  sp.add_argument("--remat", default=None, help="the student's remat policy: none, dots, dots_no_batch, full")
  sp.add_argument("--chunk-size", type=int, default=None, help="chunked loss with this many tokens per chunk")
  sp.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                  help="both models' blocks under nnx.scan (one compiled body) or unrolled (default: as configured; "
                       "auto: stacked on the target accelerator)")
  sp.add_argument("--attention", default=None, help="both models' attention kernel: auto, explicit, xla, cudnn, "
                  "splash (the Pallas TPU kernel; seq a multiple of 128) (default: as configured / auto for presets)")
  sp.add_argument("--hbm-gib", type=float, default=None, help="memory budget per device in GiB (replaces the chip's)")
  sp.add_argument("--search", action="store_true",
                  help="compile meshes x remat x chunk sizes x batches; rank those that fit")
  sp.add_argument("--batches", default=None, help="with --search: comma-separated batch sizes (default: --batch)")
  sp.add_argument("--max-compiles", type=int, default=None, help="compilations allowed for suggestions / --search (default: 4 / 12)")
  sp.add_argument("--json", action="store_true", help="print JSON instead of the table")
  sp.add_argument("--fast-compile", action="store_true", help="XLA's least execution-time effort: 2-3x less compile "
                  "time, but memory and bytes accessed of another program (about -13%% to +3%% memory); for a first "
                  "look, not for renting")
  sp.add_argument("--placement", type=int, nargs="?", const=32, default=None, metavar="K",
                  help="also compare where the teacher lives (in the step, a sub-mesh, an offline top-K cache, a "
                  "remote teacher) and recommend one (K: top-k kept per token, default 32)")
