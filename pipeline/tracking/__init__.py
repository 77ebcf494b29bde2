"""What MLflow holds of a job, written from the driver only: the store and a run's life
(``mlflow_store``), a training run's record (``tracker``), each write as a record MLflow takes once
(``delivery``) kept on disk and sent while training goes on (``spool``), the data as MLflow datasets
(``lineage``), LoggedModels and the registry (``models``), stage=evaluate's report (``scores``)."""
