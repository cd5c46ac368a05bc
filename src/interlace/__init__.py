"""interlace: hybrid-parallel training of dense and Mixture-of-Experts transformers.

plan = interlace.Plan.parse("dp=2")
mesh = interlace.build_mesh(plan)            # inside an initialised process group
setup = interlace.prepare_run(interlace.TrainConfig(model="tiny"), plan, world_size=2)
interlace.Trainer(setup, mesh).fit()

The names below load on first use (PEP 562), so importing one module of the package (the CLI,
`python -m interlace.train` under torchrun) never imports the others.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointError": "interlace.errors",
    "ConfigError": "interlace.errors",
    "DataError": "interlace.errors",
    "InterlaceError": "interlace.errors",
    "PlanError": "interlace.errors",
    "GPT": "interlace.models.gpt",
    "build_model": "interlace.models.gpt",
    "GPTConfig": "interlace.models.config",
    "get_preset": "interlace.models.presets",
    "Mesh": "interlace.mesh",
    "build_mesh": "interlace.mesh",
    "Plan": "interlace.plan",
    "TrainConfig": "interlace.train_config",
    "parallelize": "interlace.parallel.parallelize",
    "Trainer": "interlace.train",
    "prepare_run": "interlace.train",
    "testing": "interlace.testing",
}


def __getattr__(name: str) -> object:
    """The public names of `__all__`, each imported from its module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'interlace' has no attribute '{name}'")
    module = importlib.import_module(_EXPORTS[name])
    return module if name == "testing" else getattr(module, name)


__all__ = sorted(_EXPORTS)
