"""Where a job runs, on the driver: Ray started or joined (``cluster``), what is checked once it is up
(``checks``), Ray lost under a run noticed (``lifeline``), local paths and ``s3://`` as pyarrow filesystems
(``filesystems``)."""
