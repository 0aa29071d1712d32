"""Real-protocol servers owned by the tests, bound to 127.0.0.1 on free ports: SeaweedFS (`weed
mini`, S3) and a Hugging Face Hub-protocol server (Starlette + uvicorn, files on disk)."""
