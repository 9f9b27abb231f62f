"""KV-page integrity: page tags, the per-request ledger and the batched pre-decode check (`tags`, `ledger`,
`tracker`, `triton_check`), its simulator and benchmark, and the SGLang plugin (`sglang`, `sglang_check`) with
the campaign that runs it inside SGLang's own classes (`campaign`, `sglang_env`)."""
