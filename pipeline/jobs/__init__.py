"""The jobs a command runs, where tracking and training meet: a training job (``train``'s TrainingJob), where a
job sits and what it returns (``job``), every check before Ray starts (``preflight``), batch prediction
(``predict``), a Hydra sweep's record (``sweep``), a sweep on Ray Tune and its trials (``tune``, ``trial``)."""
