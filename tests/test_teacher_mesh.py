"""A live teacher on its own devices: same numbers as a teacher on the student's mesh, no teacher weights
on the student's devices, the teacher one batch ahead, and a clear error for a bad device split."""

import time

import jax
import numpy as np
import pytest
from helpers import STUDENT_CFG, TEACHER_CFG, make_batch

import meshdistill as md
from meshdistill.strategies import LogitKD
from meshdistill.teachers.mesh import TeacherMeshData, TeacherOnMesh, addressable_bytes, split_meshes

STRATEGY = LogitKD(top_k=4, temperature=2.0, alpha=0.5)


def test_submesh_teacher_equals_same_mesh_teacher_and_runs_one_batch_ahead():
  teacher_mesh, student_mesh = split_meshes(teacher=(1, 4), student=(2, 2))
  teacher = md.init_model(TEACHER_CFG, seed=0)
  student = md.init_model(STUDENT_CFG, seed=1)
  batches = [make_batch(seed=i) for i in range(3)]

  same = md.Distiller(student, teacher, mesh=student_mesh, strategy=STRATEGY)
  state = same.init_state()
  want = []
  for batch in batches:
    state, metrics = same.step(state, batch)
    want.append(float(metrics["loss"]))

  on_mesh = TeacherOnMesh(teacher, k=4, temperature=2.0, teacher_mesh=teacher_mesh, student_mesh=student_mesh)
  split = md.Distiller(student, on_mesh.spec(), mesh=student_mesh, strategy=STRATEGY)
  state = split.init_state()
  got, done = [], []
  for batch in on_mesh.batches(batches):
    state, metrics = split.step(state, batch)
    got.append(float(jax.block_until_ready(metrics["loss"])))
    done.append(time.perf_counter())
  np.testing.assert_allclose(got, want, rtol=1e-5)

  # the teacher's weights live on the teacher mesh only
  held = addressable_bytes(on_mesh.program.params, jax.devices())
  assert all(held[d] == 0 for d in student_mesh.devices.flat)
  assert all(held[d] > 0 for d in teacher_mesh.devices.flat)
  assert split.teacher_params == {} and split.teacher_def is None
  # the teacher's work for batch s+1 was issued before the student's step s finished
  issued = {i: t for event, i, t in on_mesh.dispatch_log if event == "teacher"}
  assert sorted(issued) == [0, 1, 2]
  for s in range(len(batches) - 1):
    assert issued[s + 1] < done[s]


def test_teacher_devices_leaving_the_student_too_few_is_an_error():
  with pytest.raises(ValueError, match=r"teacher.devices=2x4 takes 8 of the 8 devices and leaves the student 0"):
    split_meshes(teacher=(2, 4), student=(2, 2))
  with pytest.raises(ValueError, match="teacher.devices.tensor=0"):
    split_meshes(teacher=(1, 0), student=(2, 2))


def test_teacher_devices_name_any_mesh_axis_and_the_pair_form_still_works():
  from meshdistill.config import ConfigError, load_config
  from meshdistill.teachers import kinds

  teacher_mesh, student_mesh = split_meshes(teacher={"data": 1, "expert": 2, "tensor": 2}, student=(2, 2))
  assert dict(teacher_mesh.shape) == {"data": 1, "expert": 2, "tensor": 2} and dict(student_mesh.shape) == {
      "data": 2, "tensor": 2}
  assert not set(teacher_mesh.devices.flat) & set(student_mesh.devices.flat)
  with pytest.raises(ValueError, match=r"teacher.devices=data=2,expert=2,tensor=2 takes 8 of the 8 devices"):
    split_meshes(teacher={"data": 2, "expert": 2, "tensor": 2}, student=(1, 1))
  cfg = load_config("tiny", ["teacher.devices={data: 1, expert: 2, tensor: 2}", "mesh.data=2", "mesh.tensor=2"])
  assert cfg.models.teacher_devices == {"data": 1, "expert": 2, "tensor": 2}
  assert kinds.for_config(cfg).extra_devices() == 4
  with pytest.raises(ConfigError, match=r"teacher.devices=.*unknown mesh axis 'pipe'"):
    load_config("tiny", ["teacher.devices={data: 1, pipe: 2, tensor: 2}"])


class _Batches:
  """A stand-in data bundle: ``make_batch(seed=i)`` for i = 0, 1, ... with a position state."""

  def train_iterator(self, state=None):
    return _Positioned(0 if state is None else state["next"])


class _Positioned:
  def __init__(self, start):
    self.next = start

  def __next__(self):
    self.next += 1
    return make_batch(seed=self.next - 1)

  def get_state(self):
    return {"next": self.next}

  def set_state(self, state):
    self.next = state["next"]

  def close(self):
    pass


def test_ahead_iterator_state_is_the_next_batch_it_hands_out():
  teacher_mesh, student_mesh = split_meshes(teacher=(1, 4), student=(2, 2))
  on_mesh = TeacherOnMesh(md.init_model(TEACHER_CFG, seed=0), k=4, temperature=2.0, teacher_mesh=teacher_mesh,
                          student_mesh=student_mesh)
  it = TeacherMeshData(_Batches(), on_mesh).train_iterator()
  next(it), next(it)
  assert it.get_state() == {"next": 2}  # the teacher is already working on batch 3, which is not handed out yet
  resumed = TeacherMeshData(_Batches(), on_mesh).train_iterator(it.get_state())
  a, b = next(it), next(resumed)
  np.testing.assert_array_equal(a["inputs"], make_batch(seed=2)["inputs"])
  for key in ("inputs", "teacher_ids", "teacher_logprobs"):
    np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
  assert a["teacher_ids"].sharding.mesh == student_mesh


def test_teacher_devices_and_cache_config_keys_are_checked():
  from meshdistill.config import ConfigError, load_config

  cfg = load_config("tiny", ["teacher.devices={data: 1, tensor: 4}", "mesh.data=2", "mesh.tensor=2"])
  assert cfg.models.teacher_devices == {"data": 1, "tensor": 4}
  assert cfg.to_dict()["teacher"]["devices"] == {"data": 1, "tensor": 4}
  cfg = load_config("tiny", ["teacher.cache=some/cache"])
  assert cfg.models.teacher_cache.endswith("some/cache")
  assert cfg.to_dict()["teacher"]["cache"] == cfg.models.teacher_cache
  with pytest.raises(ConfigError, match="teacher.devices="):
    load_config("tiny", ["teacher.devices={data: 1, tensor: 0}"])
  with pytest.raises(ConfigError, match="exclude each other"):
    load_config("tiny", ["teacher.devices={data: 1, tensor: 4}", "teacher.cache=x"])


@pytest.mark.parametrize("sets, named", [
    (["distill.kind=chunked_logit_kd"], "distill.kind=chunked_logit_kd needs more"),
    ([], "distill.kind=logit_kd without distill.top_k needs more"),
    (["distill.kind=attention_transfer"], "distill.kind=attention_transfer needs more"),
])
def test_teacher_devices_with_a_strategy_that_needs_more_than_top_k_is_an_error(tmp_path, sets, named):
  """Before any data or teacher is loaded: the sub-mesh teacher sends top-k only."""
  from meshdistill import jobs
  from meshdistill.config import ConfigError, load_config

  cfg = load_config("tiny", ["teacher.devices={data: 1, tensor: 4}", "mesh.data=2", "mesh.tensor=2",
                             f"run.run_dir={tmp_path / 'run'}", *sets])
  with pytest.raises(ConfigError, match=f"teacher.devices sends the student the teacher's top-k only.*{named}"):
    jobs.distill(cfg)
  assert not (tmp_path / "run" / "config.yaml").exists()
