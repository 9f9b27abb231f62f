"""Code that runs inside a serving engine: KV-page integrity (`integrity/`: tags, ledger, batched check, the
SGLang plugin and its campaign) and the prefill/decode KV hand-off (`pd/`: the SGLang plugin and its staging).
What the engines do with a checkpoint, as data, lives in `quantkit.engines`."""
