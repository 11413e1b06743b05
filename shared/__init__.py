"""Pure code both sides share (torch, numpy, pydantic, zstandard, safetensors, numba where installed,
and the standard library only).

    model.py      ModelConfig + the transformer; param schema, get/set params, eval loss
    data.py       corpus -> byte tokens -> shards (deterministic), held-out split, batches
    config.py     RunConfig and its parts (InnerConfig, CompressionConfig, OuterConfig)
    protocol.py   the JSON contract of /api/v1 and its version
    codec/        the delta wire format (versioned envelope, index and value codecs)
    snapshot.py   model snapshots: zstd(safetensors), checked on load
    algorithms/   the math of a round: the algorithm registry, inner steps, compression + error
                  feedback, merge rule, exchanges, model updates
    kernels.py    compiled (numba) inner loops of a merge, each with its numpy/torch fallback
    files.py      durable file writes (temp file, fsync, rename)
    errors.py     the exception tree
"""
