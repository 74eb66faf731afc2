"""The sections of ``benches/bench_planner.py``, one module each; run them through that script.

``timing`` (round-robin medians and the printed tables) and ``common`` (NIXL agents, the ``PeerPlan``
binding) serve every section: ``tables`` (1), ``prep`` (2), ``planning`` (3) and ``e2e`` (4).
"""
