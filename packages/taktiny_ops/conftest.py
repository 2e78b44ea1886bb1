"""Doctest namespace for taktiny_ops (the seed's examples use `jnp`)."""

import jax.numpy as jnp
import pytest


@pytest.fixture(autouse=True)
def _doctest_jnp(doctest_namespace: dict) -> None:
    doctest_namespace["jnp"] = jnp

