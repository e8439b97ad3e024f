"""Tools beside the library core: benchmarks (``bench``, ``bench_tree``, ``bench_vl``), the aten-op count of a step
against the plain one (``opcount``), the plain per-row reference computation (``reference``), ``sp.verify``
(``verify``) and the model zoo (``zoo``).

The core (layout, attention, schedule, model, parallel, api) never imports this package; ``sp.verify`` is
resolved lazily, and ``verify`` registers the opt-in first-use self-check (``SHAREDPREFIX_SELF_CHECK=1``) with
``api.register_call_check`` when imported. The calls import it by name when that setting is on (``settings``'
``plugin``, the one way a setting implemented outside the core is loaded).
"""
