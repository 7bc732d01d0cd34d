"""Training a built model: the loop (``loop``), one optimizer step (``step``), the optimizer and schedule
(``optim``), what a run leaves behind (``outputs``), the training state (``state``) and stopping."""
