"""What every plan of one run is made against, held once: the model's config, the target device, the memory
budget, the traces the plans share and where their lines go.

The planner's searches pass one ``PlanContext`` instead of the same five arguments each; ``Planner``
(``leantune.planning.planner``) is the same context with the entry point's questions as methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from leantune.planning.fake_step import StepTraces


@dataclass(frozen=True)
class PlanContext:
    model_config: object  # the model's Hugging Face config (``ModelFacts.config``), as the run will build it
    target: torch.device  # where the run trains: the device its plans are made for
    budget: Optional[int] = None  # bytes the run may use on the target (None: no budget, the CPU without one)
    traces: Optional[StepTraces] = None  # steps traced so far, shared by every plan of the run (None: none kept)
    log: Callable[[str], None] = print
