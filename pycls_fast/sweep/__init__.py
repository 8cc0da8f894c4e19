"""Sweeps (pycls's design-space sweeps): sample config forks, run them, collect
their stats, analyze the population. docs/SWEEPS.md describes the flow.

    config.py       the sweep config (YAML schema, checks)
    rand.py         random values in [low, high] quantized (pycls's sweep/random.py)
    samplers.py     samplers of config values: value, grid, float, int, list
    constraints.py  complexity ranges and expressions a fork must satisfy
    setup.py        sample and write the forks (cfgs/, cfgs.json)
    runs.py         a run's status from its files (done / failed / ...)
    launcher.py     run the forks through a backend (local subprocesses for now)
    collect.py      gather every run into sweep.json
    analysis.py     the figures; report.py: the analysis page

The top layer: it imports config, models (complexity), observe.logging and
observe.plots, runtime.run_lock, never launch or the tools.
"""
