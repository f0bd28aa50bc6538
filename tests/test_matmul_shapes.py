"""`benchmarks/bench/matmuls.py` (used by `matmul_shapes.py` and `throughput.py`): the dots of a program read from
its StableHLO, with their runs and FLOPs."""

import jax
import jax.numpy as jnp
import pytest

from helpers import bench_module


@pytest.fixture(scope="module")
def shapes():
  return bench_module("matmuls")


def test_dots_in_a_function_called_twice_count_twice_with_their_batch_and_contracting_dims(shapes):
  @jax.jit
  def inner(x_NxD, w_DxF):
    return jnp.tanh(x_NxD @ w_DxF)

  def program(x_NxD, w_DxF, q_BxTxK, k_BxSxK):
    h = inner(inner(x_NxD, w_DxF) @ w_DxF.T, w_DxF)
    return h, jnp.einsum("btk,bsk->bts", q_BxTxK, k_BxSxK)

  args = (jnp.ones((6, 4)), jnp.ones((4, 5)), jnp.ones((3, 7, 2)), jnp.ones((3, 9, 2)))
  dots = shapes.dots_of(jax.jit(program).lower(*args).as_text())
  D = shapes.Dot
  assert dots == {
      D((6, 4), (4, 5), (1,), (0,), (), ()): 2,  # `inner`, called twice
      D((6, 5), (5, 4), (1,), (0,), (), ()): 1,  # `w.T` is a transpose of its own before the dot
      D((3, 7, 2), (3, 9, 2), (2,), (2,), (0,), (0,)): 1,
  }
  assert [shapes.flops(d) for d in dots] == [2 * 6 * 5 * 4, 2 * 6 * 4 * 5, 2 * 3 * 7 * 9 * 2]


def test_a_program_with_a_loop_is_refused(shapes):
  def program(x_NxN):
    return jax.lax.fori_loop(0, 3, lambda i, y: y @ x_NxN, x_NxN)

  with pytest.raises(ValueError, match="loop"):
    shapes.dots_of(jax.jit(program).lower(jnp.ones((4, 4))).as_text())
