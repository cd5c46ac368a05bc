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
from interlace.plan import Plan
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

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
    "prepare_run",
    "testing",
]
