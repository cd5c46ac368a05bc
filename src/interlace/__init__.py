"""interlace: hybrid-parallel training of dense and Mixture-of-Experts transformers.

plan = interlace.Plan.parse("dp=2")
mesh = interlace.build_mesh(plan)            # inside an initialised process group
setup = interlace.prepare_run(interlace.TrainConfig(model="tiny"), plan, world_size=2)
interlace.Trainer(setup, mesh).fit()
"""

__version__ = "0.1.0"

from interlace import testing
from interlace.errors import CheckpointError, ConfigError, DataError, InterlaceError, PlanError
from interlace.mesh import Mesh, build_mesh
from interlace.models import GPT, GPTConfig, build_model, get_preset
from interlace.parallelize import parallelize
from interlace.plan import Plan
from interlace.train_config import TrainConfig


def __getattr__(name: str) -> object:
    """`Trainer` and `prepare_run` load on first use, so `python -m interlace.train` (torchrun)
    does not find its own module imported already."""
    if name in ("Trainer", "prepare_run"):
        from interlace import train

        return getattr(train, name)
    raise AttributeError(f"module 'interlace' has no attribute '{name}'")


__all__ = [
    "GPT",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "GPTConfig",
    "InterlaceError",
    "Mesh",
    "Plan",
    "PlanError",
    "TrainConfig",
    "Trainer",
    "build_mesh",
    "build_model",
    "get_preset",
    "parallelize",
    "prepare_run",
    "testing",
]
