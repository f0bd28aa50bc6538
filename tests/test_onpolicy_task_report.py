"""The on-policy task benchmark's chip mode (`benchmarks/onpolicy_task.py`) on tiny models: a required backend that is
not this one refuses to run, arms in lockstep stop together when the budget is spent and say so, lockstep gives each
arm and seed the numbers it gets alone, and the report renders a chip section from such a run (and, without one,
exactly the committed report)."""

import copy
import importlib.util
import itertools
import json
import pathlib

import jax
import pytest
from helpers import bench_module

ROOT = pathlib.Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def bench():
  bench_module("results")  # puts benchmarks/ on the path, as running the script does
  spec = importlib.util.spec_from_file_location("onpolicy_task_script", ROOT / "benchmarks" / "onpolicy_task.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def report():
  return bench_module("render_onpolicy_task")


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("state")  # the tiny teacher and warm starts, trained once for the module


def tiny(state_dir, out, *more):
  """A run of seconds: teacher and student of one block, 2 seeds, 2 arms (one of them sampling)."""
  return ["--task", "add5", "--seeds", "0,1", "--train-problems", "300", "--eval-prompts", "16", "--batch", "8",
          "--teacher", "16,1", "--student", "8,1", "--teacher-steps", "4", "--warm-band", "0.0,1.0",
          "--warm-check", "2", "--eval-every", "2", "--arms", "offpolicy,sampled", "--state-dir", str(state_dir),
          "--out", str(out), *more]


@pytest.mark.parametrize("flags, says", [
    (["--require-backend", "tpu"], "JAX's default backend is cpu"),
    (["--budget", "5"], "--arm-lrs cpu"),  # a sweep does not run in lockstep
    (["--arm-lrs", "offpolicy=1e-3"], "one rate for each arm of --arms: offpolicy,sampled"),
    (["--task", "add5,chain12"], "must hold {task}"),
])
def test_a_run_it_cannot_make_honestly_is_refused_before_anything_trains(bench, tmp_path, capsys, flags, says):
  out = tmp_path / "r.json"
  with pytest.raises(SystemExit) as stop:
    bench.main(tiny(tmp_path / "state", out) + flags)  # a flag given twice: the last one counts
  assert stop.value.code == 2 and says in capsys.readouterr().err
  assert not out.exists() and not (tmp_path / "state").exists()  # nothing was run


def test_the_budget_stops_every_arm_at_the_same_step_and_the_results_say_where(bench, state_dir, tmp_path,
                                                                               monkeypatch):
  clock = itertools.count()  # the budget's clock moves one second each time it is read: before each lockstep step
  monkeypatch.setattr(bench, "_now", lambda: float(next(clock)))
  out = tmp_path / "chip_{task}.json"
  log = tmp_path / "log.txt"
  bench.main(tiny(state_dir, out, "--steps", "50", "--arm-lrs", "offpolicy=1e-3,sampled=3e-4", "--budget", "3.5",
                  "--log", str(log)))
  raw = json.loads((tmp_path / "chip_add5.json").read_text())
  lock = raw["lockstep"]
  # read at 0 (budget ends at 3.5), then before steps 1, 2, 3 (clock 1, 2, 3) and before step 4 (clock 4: spent)
  assert (lock["steps_reached"], lock["max_steps"], lock["stopped_by"], lock["budget_s"]) == (3, 50, "budget", 3.5)
  for arm in ("offpolicy", "sampled"):
    curves = raw["results"][arm]["curves"]
    assert len(curves) == 2 and all([s for s, _ in c] == [0, 2, 3] for c in curves)  # evaluated at the last step too
  assert raw["results"]["offpolicy"]["lr"] == 1e-3 and raw["lr_choice"] == {
      "mode": "fixed", "source": None, "lrs": {"offpolicy": 1e-3, "sampled": 3e-4}}
  assert raw["backend"] == "cpu" and raw["out"] == str(tmp_path / "chip_add5.json")
  text = log.read_text()
  assert "lockstep: 3 steps of at most 50 (clock)" in text and "wrote" in text


def test_lockstep_gives_each_arm_and_seed_the_numbers_it_gets_alone(bench, state_dir, tmp_path):
  """The sweep runs one arm and seed after the other; lockstep interleaves them on distillers an arm's seeds share
  (each step sampling with its seed's keys). The same rates give the same numbers: every step's training loss, the
  accuracy curve, the compute counted and the final share of off-path samples."""
  bench.main(tiny(state_dir, tmp_path / "one.json", "--steps", "3", "--lrs", "1e-2"))
  bench.main(tiny(state_dir, tmp_path / "lock.json", "--steps", "3", "--arm-lrs", "offpolicy=1e-2,sampled=1e-2"))
  alone, lock = (json.loads((tmp_path / f).read_text())["results"] for f in ("one.json", "lock.json"))
  for arm in ("offpolicy", "sampled"):
    for key in ("losses", "curves", "flops", "off_path"):
      assert lock[arm][key] == alone[arm][key], (arm, key)
    assert len(lock[arm]["losses"]) == 2 and lock[arm]["losses"][0] != lock[arm]["losses"][1]  # two seeds' own runs
  assert lock["sampled"]["flops"][0][-1] > lock["offpolicy"]["flops"][0][-1]  # the samples' compute is counted


def test_the_compilations_of_a_lockstep_run_do_not_grow_with_its_seeds(bench, tmp_path):
  """On the chip a run's time is its compilations: the seeds of an arm, and of the warm starts, share compiled
  programs (the step, the fresh state, generation), so 2 seeds compile what 1 seed does. Counted as XLA backend
  compilations of a whole run (teacher, warm starts, arms, evaluations) from empty in-memory caches (the event fires
  for every executable asked of the compiler, a hit of the persistent compilation cache included)."""
  compiles = []

  def count(name, secs, **kwargs):
    if name == "/jax/core/compile/backend_compile_duration":
      compiles.append(secs)

  def compilations(seeds):
    jax.clear_caches()
    compiles.clear()
    bench.main(["--task", "add5", "--seeds", seeds, "--train-problems", "200", "--eval-prompts", "8", "--batch", "8",
                "--teacher", "8,1", "--student", "8,1", "--teacher-steps", "2", "--warm-band", "0.0,1.0",
                "--warm-check", "1", "--steps", "2", "--eval-every", "1", "--arms", "sampled",
                "--arm-lrs", "sampled=1e-3", "--state-dir", str(tmp_path / seeds), "--out", str(tmp_path / "r.json")])
    return len(compiles)

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    one, two = compilations("0"), compilations("0,1")
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert one > 0 and two == one, (one, two)


def test_the_arms_warm_up_rises_linearly_to_the_rate_and_zero_keeps_it_constant(bench, report, tmp_path):
  lr = bench.warmed_up(3e-3, 10)
  assert [float(lr(c)) for c in (0, 4, 9, 50)] == pytest.approx([3e-4, 1.5e-3, 3e-3, 3e-3])
  assert bench.warmed_up(3e-3, 0) == 3e-3  # the CPU runs' constant rate, as before
  cpu = json.loads((RESULTS / "on_policy_task_add5.json").read_text())
  chip = _chip_raw(cpu)
  chip["args"]["arm_warmup"] = 10
  report.render([cpu, chip], str(tmp_path / "r.md"), str(tmp_path / "r.png"))
  assert "fresh Adam, each arm's rate the one the CPU run's sweep chose" in (tmp_path / "r.md").read_text()
  assert "warmed up linearly over the first 10 steps (--arm-warmup)" in (tmp_path / "r.md").read_text()


def _chip_raw(cpu):
  """A lockstep run's raw results made from ``cpu``'s (two arms, two seeds, 75 steps reached)."""
  raw = {k: copy.deepcopy(cpu[k]) for k in ("args", "seeds", "labels", "params", "flops_per_step", "warm")}
  raw["args"].update(teacher="512,4", student="256,4", batch=256)
  raw["seeds"], raw["warm"] = [0, 1], {s: raw["warm"][s] for s in ("0", "1")}
  raw["labels"] = {k: raw["labels"][k] for k in ("offpolicy", "sampled")}
  curves = {"offpolicy": [[[0, 0.4], [50, 0.6], [75, 0.91]], [[0, 0.3], [50, 0.5], [75, 0.83]]],
            "sampled": [[[0, 0.4], [50, 0.7], [75, 0.97]], [[0, 0.3], [50, 0.6], [75, 0.95]]]}
  raw["results"] = {k: {"sweep": {}, "curves": c, "flops": [[0, 1e12, 2e12]] * 2, "seconds": 9.0,
                        "lr": {"offpolicy": 3e-3, "sampled": 3e-4}[k], "off_path": [0.1, 0.2]}
                    for k, c in curves.items()}
  raw.update(command="python benchmarks/onpolicy_task.py --task add5 --require-backend tpu --budget 120",
             teacher_acc=0.996, backend="tpu", device_kind="TPU v5 lite", jax="0.11.2", total_seconds=231.0,
             machine="1 x TPU v5 lite, jax 0.11.2", out="benchmarks/results/on_policy_task_chip_add5.json",
             teacher={"steps": 400, "stopped_by": "target"},
             lockstep={"steps_reached": 75, "max_steps": 200, "stopped_by": "budget", "runs": 4, "budget_s": 120.0,
                       "deadline_s": 230.0},
             lr_choice={"mode": "cpu", "source": "benchmarks/results/on_policy_task_add5.json",
                        "lrs": {"offpolicy": 3e-3, "sampled": 3e-4}},
             phase_seconds={"teacher": 40.0, "warm": 50.0, "arms": 120.0, "final_eval": 6.0})
  return raw


def test_the_chip_section_renders_from_a_lockstep_run_and_compares_the_ranking(report, tmp_path):
  cpu = [json.loads((RESULTS / f"on_policy_task_{t}.json").read_text()) for t in ("add5", "chain12")]
  chip = _chip_raw(cpu[0])
  report.render([*cpu, chip], str(tmp_path / "on_policy_task.md"), str(tmp_path / "on_policy_task.png"),
                paths=["a.json", "b.json", "benchmarks/results/on_policy_task_chip_add5.json"])
  text = (tmp_path / "on_policy_task.md").read_text()
  section = text[text.index("## On the chip, larger student"):]
  for want in (chip["command"], "Backend `tpu` (TPU v5 lite), jax 0.11.2", "Teacher d,L=512,4", "Student d,L=256,4",
               "**75 steps reached** of at most 200 (stopped by the arms' budget (--budget)",
               "stopped by its target accuracy (--teacher-target): **0.996**",
               "| off-policy KD (forward KL, lambda 0) | 0.003 | 0.910 | 0.830 | 0.870 +- 0.040 | 0.150 |",
               "| sampled-token (discount 0, lambda 1) | 0.0003 | 0.970 | 0.950 | 0.960 +- 0.010 | 0.150 |",
               "on the chip (step 75): sampled 0.960 > offpolicy 0.870.",
               # the CPU run ranks them the other way: at its final step (200) and at its step 75
               "at step 200: offpolicy 0.953 > sampled 0.536; the chip's ranking: a different order (0 of 1 pairs",
               "at step 75: offpolicy 0.858 > sampled 0.417; the chip's ranking: a different order"):
    assert want in section, want
  assert "`chain12` on the chip" not in section  # one section per lockstep run
  assert ("--render benchmarks/results/on_policy_task_add5.json benchmarks/results/on_policy_task_chain12.json "
          "benchmarks/results/on_policy_task_chip_add5.json\n") in text  # the CPU runs' files by their task


def test_a_chip_run_that_reaches_the_cpu_runs_last_step_compares_the_ranking_once(report, tmp_path):
  cpu = [json.loads((RESULTS / f"on_policy_task_{t}.json").read_text()) for t in ("add5", "chain12")]
  chip = _chip_raw(cpu[0])
  chip["lockstep"]["steps_reached"] = 200  # the CPU run's final evaluation is also the one nearest the chip's steps
  report.render([*cpu, chip], str(tmp_path / "on_policy_task.md"), str(tmp_path / "on_policy_task.png"))
  text = (tmp_path / "on_policy_task.md").read_text()
  assert text.count("its swept rates) at step 200: offpolicy 0.953 > sampled 0.536") == 1


def test_the_report_renders_as_committed_from_its_stored_runs(report, tmp_path):
  names = ("on_policy_task_add5.json", "on_policy_task_chain12.json", "on_policy_task_chip_add5.json")
  raws = [json.loads((RESULTS / n).read_text()) for n in names]
  report.render(raws, str(tmp_path / "on_policy_task.md"), str(tmp_path / "on_policy_task.png"),
                paths=[f"benchmarks/results/{n}" for n in names])
  assert (tmp_path / "on_policy_task.md").read_text() == (RESULTS / "on_policy_task.md").read_text()


def test_the_chip_section_names_libtpu_when_the_run_recorded_it(report, tmp_path):
  cpu = [json.loads((RESULTS / f"on_policy_task_{t}.json").read_text()) for t in ("add5", "chain12")]
  chip = {**_chip_raw(cpu[0]), "libtpu": "0.0.42.1"}
  report.render([*cpu, chip], str(tmp_path / "on_policy_task.md"), str(tmp_path / "on_policy_task.png"))
  assert "Backend `tpu` (TPU v5 lite), jax 0.11.2, libtpu 0.0.42.1;" in (tmp_path / "on_policy_task.md").read_text()
