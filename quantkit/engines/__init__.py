"""What SGLang and vLLM do with a checkpoint, read from their released sources and confirmed by executing them
(`tests/engines/`): the facts a checkpoint carries (`facts`), the per-engine verdicts and launch args
(`verdicts`), FP4 rules (`fp4`), the KV scale each attention backend really applies (`kv_backends`) and the
SGLang prefill/decode pair (`pd`). Import from the defining module."""
