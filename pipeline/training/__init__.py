"""Training with Ray Train: the driver builds the ``TorchTrainer`` and relays the workers' events
(``trainer``, ``relay``, the events themselves in ``events``); each worker runs the loop in ``worker``,
with ``finetune``, ``early_stop``, ``telemetry``, the task's loss and metrics (``task``), the features' scaling
(``scaling``) and mixed precision (``precision``); the checkpoint format is ``checkpoint``. Knows nothing of
MLflow."""
