"""Reimplementations of hybrid-kv's table and id computations, for benchmark comparison only.

* :mod:`.numpy_impl` builds them the way vLLM's NIXL connector has since PR #48209: N x 3 ``uint64``
  arrays made by NumPy broadcasting (and the N x 5 strided rows of vLLM 0.33.0, for reference).
* :mod:`.python_loop` builds them with plain Python loops over every descriptor, the way split
  ("per-source") tables are still built and every table was built before PR #48209.

Both follow the formulas of vLLM 0.33's NIXL connector and
read their inputs from a :class:`.geometry.Geometry` taken from a hybrid-kv ``RegionTable``, so each
computes exactly what hybrid-kv computes; the benchmark checks that the outputs are equal.
Nothing here is used by the package.
"""
