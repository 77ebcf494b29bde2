"""What every layer needs and that imports no other part of the pipeline: the error a user reads
(``errors``), every metric declared once (``metrics``), the console (``console``), Ctrl-C and SIGTERM as
exceptions (``signals``), and the small workarounds for Ray's, Hydra's and MLflow's behaviour (``workarounds``)."""
