"""Storage and publishing: the one fsspec seam (local, NFS, s3://), checksummed S3 transfers,
and the checkpoint publisher with its handshake marker.
"""
