"""The jobs a command runs, where tracking and training meet: one training run (``train``), the parts a
run and a Tune trial build alike (``build``), every check before a run exists (``preflight``), batch
prediction (``predict``), a Hydra sweep's record (``sweep``), a sweep on Ray Tune and its trials
(``tune``, ``trial``)."""
