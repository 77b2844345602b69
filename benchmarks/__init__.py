"""The benchmark harness: flashattn against PyTorch's attention backends, in one run on one GPU.

    PYTHONPATH=. python -m benchmarks.run            # the full grid, about 8 minutes on an H100/H200
    PYTHONPATH=. python -m benchmarks.run --quick    # a smaller grid
    PYTHONPATH=. python -m benchmarks.report         # plots + summary.md from a results file

Modules, in the order a run uses them: :mod:`benchmarks.grid` (which shapes), :mod:`benchmarks.providers`
(who is measured), :mod:`benchmarks.measure` (how: timing, FLOPs, memory, the correctness check),
:mod:`benchmarks.run` (the loop and the command line), :mod:`benchmarks.results` (the JSON file),
:mod:`benchmarks.report` (tables and plots). ``benchmarks/README.md`` says what is measured and why.
"""
