"""The data a job trains on, as Ray Data datasets: parquet found and checked (``source``, example data in
``datasets``), the configured steps (``steps``), and each split cached (``cache``) or streamed (``stream``),
both as row-group pieces gathered in a seeded order (``pieces``), put together by ``preprocess``. The
driver plans; Ray tasks and actors do the reading and the steps."""
