"""Storage and publishing: the one fsspec seam (local, NFS, s3://), checksummed S3 transfers, the
checkpoint publisher with its handshake marker, and the run-root lease.

- fs.py         the one storage seam: fsspec
- handshake.py  the publish handshake between the Prefect task and the engine: one marker file
- lease.py      one writer per run root: `.lease.json` kept alive by a heartbeat
- oserrors.py   an OS error during a stage in one line: path, filesystem, space, fix
- publisher.py  committed checkpoints published beside training
- s3.py         parallel, checksummed S3 transfers
"""
