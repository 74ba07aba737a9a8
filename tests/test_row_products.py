"""model.layers.row_products: a few token rows go through a weight one by one
(matrix-vector products on a CPU), with the one product's values."""
import jax
import numpy as np
import pytest

from model.layers import MATVEC_ROWS, row_products


@pytest.mark.parametrize("rows", [1, 2, MATVEC_ROWS, MATVEC_ROWS + 1])
def test_a_few_rows_run_one_by_one_with_the_products_values(rows):
  x_NI = jax.random.normal(jax.random.key(0), (rows, 16))
  w_IO = jax.random.normal(jax.random.key(1), (16, 8))
  calls = []

  def product(x):
    calls.append(x.shape[0])
    return x @ w_IO

  np.testing.assert_allclose(row_products(product, x_NI), x_NI @ w_IO, rtol=1e-6, atol=1e-6)
  assert calls == ([1] * rows if 1 < rows <= MATVEC_ROWS else [rows])
