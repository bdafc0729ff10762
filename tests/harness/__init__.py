"""The tests' and benchmarks' harnesses (never shipped): Dynamo's processes and indexer, a Mooncake
cluster, an S3 emulator, SGLang's pools and tree driven in process, runtime patches for server processes."""
