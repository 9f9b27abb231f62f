"""Planner and reports: what each precision plan fits and serves, per GPU.

`quantkit plan` (planner.py) sizes checkpoints per precision plan from config.json or shard headers
(inventory.py), shards them across GPUs and sizes the KV pool (memory.py, kv.py), models decode and
prefill speed (throughput.py) and recommends a PD-disaggregated deployment (recommend.py);
`quantkit report` (report.py, html.py) reads a real checkpoint's headers. GPU figures: catalog.py +
gpus.yaml; bundled model configs: configs/ (see configs/PROVENANCE.md).
"""
