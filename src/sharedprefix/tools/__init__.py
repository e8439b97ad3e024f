"""Tools beside the library core: benchmarks (``bench``, ``bench_tree``, ``bench_vl``), the plain per-row
reference computation (``reference``), ``sp.verify`` (``verify``) and the model zoo (``zoo``).

The core (layout, attention, schedule, modeling) never imports this package; ``sp.verify`` is resolved
lazily, and the opt-in first-use self-check (``SHAREDPREFIX_SELF_CHECK=1``) imports ``verify`` only when set.
"""
