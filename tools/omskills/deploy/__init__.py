"""Deploying what was adapted: the user's model with its compiled graphs spliced in, in the user's
application (`load_adapted`) or in a movable bundle."""

# - `load_adapted(path, backend)`: from a verified run's task record or a bundle, the object users
#   call with every integrated graph spliced in on the OM (ais_bench), ONNX Runtime (CPU, CUDA,
#   CANN) or the best present;
# - `bundle.write_bundle(task)`: one self-contained, movable folder with the artifacts (hashed),
#   contracts, ATC scripts, a README and an example script (`omskills bundle TASK`).
# Nothing here imports the study, capture, profiling or export machinery.

from omskills.deploy.adapted import AdaptedModel, LoadTimes, load_adapted
from omskills.deploy.manifest import DeployError

__all__ = ["AdaptedModel", "DeployError", "LoadTimes", "load_adapted"]
