"""Building what a run trains with, from its config: below the entry point and the planner, which both use it.

``model`` (LoRA, placement, checkpointing, the loss), ``step`` (the loss model, optimizer and
finite check as one ``TrainStep``), ``loaders``, ``monitor`` and ``sharding`` (the process group
and FSDP2). Nothing here trains or plans. (Not named ``build``: tools and ignore files take a
``build/`` folder for generated output.)
"""
