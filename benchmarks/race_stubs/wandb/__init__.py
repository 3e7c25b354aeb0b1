"""A stand-in for the `wandb` package, which nanochat's base_train.py imports at the top even when logging is off
(``--run dummy`` uses its own DummyWandb) and which the GPU machines do not have. Anything that would log fails."""


def init(*args, **kwargs):
    raise RuntimeError("wandb stand-in (benchmarks/race_stubs): run nanochat with --run dummy")
