"""batchprompt on Ray: engine replicas as Ray actors behind the batch API and jobs
(`RayCluster`), and a Ray Data stage (`PromptStage`). Importing this package imports no Ray;
starting replicas needs it (`pip install 'batchprompt[ray]'`)."""
from .cluster import RAY_MISSING, RayCluster, ray_available
from .data import PromptStage

__all__ = ["PromptStage", "RAY_MISSING", "RayCluster", "ray_available"]
