"""Where a job runs, on the driver: Ray started or joined (``cluster``), Ray lost under a run noticed
(``lifeline``), local paths and ``s3://`` as pyarrow filesystems (``filesystems``)."""
