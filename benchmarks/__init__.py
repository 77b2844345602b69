"""The benchmark harness: flashattn against PyTorch's attention backends, in one run on one GPU.

    PYTHONPATH=. python -m benchmarks.run            # the grid, then the per-call latency section
    PYTHONPATH=. python -m benchmarks.run --quick    # a smaller grid
    PYTHONPATH=. python -m benchmarks.report         # plots + summary.md from a results file
    PYTHONPATH=. python -m benchmarks.ab HEAD~1      # A/B: the working tree against a git revision
    PYTHONPATH=. python -m benchmarks.tune configs   # sweeps of the launch choices (configs, order, ...)
    PYTHONPATH=. python -m benchmarks.registers      # registers and spills of the table, no GPU needed

Modules, in the order a run uses them: :mod:`benchmarks.grid` (which shapes), :mod:`benchmarks.providers`
(who is measured), :mod:`benchmarks.measure` (how: timing, FLOPs, memory, the correctness check),
:mod:`benchmarks.run` (the loop and the command line), :mod:`benchmarks.latency` (time per call at small
shapes), :mod:`benchmarks.results` (the JSON file), :mod:`benchmarks.report` (tables and plots).
``benchmarks/README.md`` says what is measured and why.
"""
