"""Pure code both sides share (torch, numpy, pydantic, zstandard, safetensors, tokenizers, numba where
installed, pyarrow for .parquet input, and the standard library only).

    model.py      ModelConfig (arch gpt | llama, named PRESETS) + the GPT; build, param schema,
                  get/set params, eval loss, generation
    llama.py      the Llama-style decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention)
    data.py       corpus -> byte tokens -> shards (deterministic), held-out split, batches
    tokenizer.py  the run's tokenizer: bytes (id = byte) or BPE, as a tokenizers JSON; train, load, hash
    sources.py    a corpus on disk streamed as texts: text file, folder, .jsonl, .parquet; the record
                  limit (max_record_bytes); input errors
    dataset.py    prepared datasets: prepare (stream -> token shard files + manifest), read, verify
    config.py     RunConfig and its parts (InnerConfig, CompressionConfig, OuterConfig)
    protocol.py   the JSON contract of /api/v1 and its version
    reports.py    what the coordinator reports of its runs: status, summaries, dashboard, /metrics
    codec/        the delta wire format (versioned envelope, index and value codecs)
    snapshot.py   model snapshots: zstd(safetensors), checked on load
    optim_state.py an optimizer's state by parameter name (the worker's checkpoints, the start states)
    hf.py         a model as a Hugging Face folder (config.json, transformers' tensor names, tokenizer files)
    algorithms/   the math of a round: the algorithm registry, inner steps, compression + error
                  feedback, merge rule, exchanges, model updates
    kernels.py    compiled (numba) inner loops of a merge, each with its numpy/torch fallback
    files.py      durable file writes (temp file, fsync, rename)
    errors.py     the exception tree
    extras.py     optional extras: require(module, extra) answers a missing one in one line
"""
