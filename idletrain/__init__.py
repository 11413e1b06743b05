"""The `idletrain` command line.

    cli/        argparse front end, one module per audience: the volunteer (worker run, pause, status),
                the operator (coordinator serve, run create/show, worker list, export, sample), the
                developer (demo; bench, forwarded to `python -m bench` in a source checkout)
    export.py   a run's model as a Hugging Face folder (config.json, model.safetensors, tokenizer files)
                that transformers loads: LlamaForCausalLM or GPT2LMHeadModel; the run's tokenizer
    demo.py     one-machine demo: a coordinator and N worker processes over real loopback HTTP
    harness.py  local processes over loopback: a free port, waiting for /healthz (demo, bench, tests)
"""
